"""Choices per compile target (gated_attention/core/platforms.py): code traced inside a dispatch branch
decides for that branch's kinds, and the modules' compute dtype and tile rule follow the target,
as the op's choice does (the deviceless compile for an H100: tests/tools/test_targets.py)."""

import pathlib

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gated_attention as ga
from gated_attention.core import platforms


def test_a_branch_is_traced_for_the_kinds_it_serves(monkeypatch):
    monkeypatch.setattr(platforms, "compilable", lambda: ("cpu", "gpu", "tpu"))
    seen = {}

    def branch(name):
        def fn(x):
            seen[name] = platforms.candidates(x)
            return x + (1.0 if name == "cpu" else 2.0)

        return fn

    cpu, accelerators = branch("cpu"), branch("accelerators")
    fn = jax.jit(lambda x: platforms.dispatch(dict(cpu=cpu, gpu=accelerators, tpu=accelerators), x))
    assert fn(jnp.zeros(3)).tolist() == [1.0, 1.0, 1.0]  # compiled for this CPU
    assert seen == dict(cpu=("cpu",), accelerators=("gpu", "tpu"))
    jax.jit(lambda x: platforms.candidates(x) and x)(jnp.zeros(3))  # outside: every kind again
    assert platforms.candidates(jax.ShapeDtypeStruct((3,), jnp.float32)) == ("cpu", "gpu", "tpu")


def test_a_bfloat16_module_computes_as_each_target_would(monkeypatch):
    """With a GPU compilable too, a bfloat16 Attention module stages a float32 branch for the CPU
    and a bfloat16 one for the GPU (before, the host's float32 cast reached the GPU's op); compiled
    for this CPU it gives the float32 program's result."""
    fn = hk.without_apply_rng(
        hk.transform(lambda x, m: ga.Attention(dict(num_head=2), {}, 16)(x, x, m))
    )
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 8, 16)), jnp.bfloat16)
    mask = jnp.ones((3, 1, 1, 8), bool)
    params = fn.init(jax.random.PRNGKey(0), x, mask)
    alone = jax.jit(fn.apply)(params, x, mask)
    monkeypatch.setattr(platforms, "compilable", lambda: ("cpu", "gpu"))
    with ga.record_implementation_choices() as record:
        staged = jax.jit(lambda *a: fn.apply(*a))(params, x, mask)  # traced anew
    compute = {k: v["compute_dtype"] for r in record for k, v in r["by_platform"].items()}
    assert compute == dict(cpu="float32", gpu="bfloat16"), record
    assert staged.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(staged, np.float32), np.asarray(alone, np.float32))


def test_the_registry_of_backends_is_read_where_jax_keeps_it():
    """platforms.compilable reads JAX's registered backends from a private name (no public API
    lists them without starting a device): when JAX moves it, this fails instead of the GPU
    branch silently never being staged."""
    from jax._src import xla_bridge

    jax.devices()  # the backends (and the plugins that load) registered
    registered = getattr(xla_bridge, "_backend_factories", None)
    assert isinstance(registered, dict) and "cpu" in registered
    platforms.compilable.cache_clear()
    assert ("gpu" in platforms.compilable()) == bool({"cuda", "rocm"} & set(registered))


def test_no_reference_to_files_outside_the_repository():
    """Comments cite what a reader of the repository can open (DESIGN.md is not in it)."""
    root = pathlib.Path(ga.__file__).parent
    citing = [p.name for p in root.rglob("*.py") if "DESIGN.md" in p.read_text()]
    assert citing == []


def test_the_host_is_asked_in_one_way(monkeypatch):
    """Where no platform is given, the kernels' checks and the precision policy ask
    platforms.host(), which names a ROCm or CUDA backend 'gpu' (jax.default_backend() names the
    platform; before, a backend named 'rocm' made the GPU kernel refuse its own platform)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "rocm")
    assert platforms.host() == "gpu"
    q = jax.ShapeDtypeStruct((1, 32, 2, 16), jnp.float16)
    ga.PallasAttention().check(q, q, q, (), None, compute_dtype=jnp.float16)  # no refusal
    with pytest.raises(NotImplementedError, match="runs on TPU only, the program is for 'gpu'"):
        ga.PallasTpuAttention().check(q, q, q, (), None, compute_dtype=jnp.bfloat16)
    assert ga.core.numerics.compute_dtype(jnp.bfloat16) == jnp.bfloat16  # an accelerator's policy
    assert ga.core.numerics.compute_dtype(jnp.bfloat16, backend="cpu") == jnp.float32


def test_a_gpus_capability_and_shared_memory_are_read_from_its_kind(monkeypatch):
    """A deviceless compile's abstract GPU names its kind only: the compute capability and the
    opt-in shared memory per block come from it (consumer Ampere, Ada and Blackwell included);
    a kind not known is a GPU of the least shared memory, no GPU none."""

    class Device:
        def __init__(self, kind):
            self.device_kind = kind

    for kind, capability, shared in [
        ("NVIDIA H100 80GB HBM3", (9, 0), 232_448),
        ("NVIDIA A100-SXM4-80GB", (8, 0), 166_912),
        ("NVIDIA B300", (10, 3), 232_448),
        ("NVIDIA A10G", (8, 6), 101_376),
        ("NVIDIA GeForce RTX 3090", (8, 6), 101_376),
        ("NVIDIA GeForce RTX 4090", (8, 9), 101_376),
        ("NVIDIA L40S", (8, 9), 101_376),
        ("NVIDIA RTX 6000 Ada Generation", (8, 9), 101_376),
        ("NVIDIA GeForce RTX 5090", (12, 0), 101_376),
        ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", (12, 0), 101_376),
        ("NVIDIA GB10", (12, 1), 101_376),
        ("NVIDIA Unknown", None, 101_376),
    ]:
        monkeypatch.setattr(platforms, "_gpu", lambda kind=kind: Device(kind))
        assert platforms.gpu_capability() == capability, kind
        assert platforms.gpu_shared_memory_per_block() == shared, kind
    monkeypatch.setattr(
        platforms, "_gpu", lambda kind=kind: Device("NVIDIA RTX PRO 6000 Blackwell")
    )
    assert platforms.gpu_memory_bytes() == 96 * 10**9
    monkeypatch.setattr(platforms, "_gpu", lambda: None)
    assert platforms.gpu_capability() is None and platforms.gpu_shared_memory_per_block() is None
