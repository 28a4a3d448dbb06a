"""Programs compiled for GPU and TPU targets in child processes (targets.in_child), for
tests/tools/test_targets.py: each returns plain data the test asserts on."""

from __future__ import annotations

import importlib
import warnings

import haiku as hk
import jax
import jax.numpy as jnp

import gated_attention as ga
from gated_attention.core import platforms
from gated_attention_tools import targets


def auto_choice(target: str, dtype: str, module: bool = False) -> dict:
    """The op's gradient under 'auto' (shared bias, key mask) compiled for `target` and for the
    host: what was chosen for each kind, and the kernels in each compiled program; with `module`
    also module_choice's (one child process for both: the compilers start once)."""
    dt = jnp.dtype(dtype)
    qkv = jax.ShapeDtypeStruct((2, 96, 4, 32), dt)
    bias = jax.ShapeDtypeStruct((1, 4, 96, 96), dt)
    mask = jax.ShapeDtypeStruct((2, 1, 1, 96), jnp.bool_)

    def step(q, k, v, bias, mask, cotangent):
        fwd = lambda q, k, v, bias: ga.dot_product_attention(q, k, v, bias, mask)
        _, vjp = jax.vjp(fwd, q, k, v, bias)
        return vjp(cotangent)

    args = (qkv, qkv, qkv, bias, mask, qkv)
    with (
        warnings.catch_warnings(record=True) as caught,
        ga.record_implementation_choices() as record,
    ):
        warnings.simplefilter("always")
        on_target = targets.compile(step, *args, target=target)
    on_host = jax.jit(step).lower(*args).compile()

    def kernels(compiled):
        text = compiled.as_text()
        return dict(
            triton="__gpu$xla.gpu.triton" in text,
            mosaic_gpu='custom_call_target="mosaic_gpu' in text,
            mosaic_tpu="tpu_custom_call" in text,
        )

    return dict(
        by_platform=record[0]["by_platform"],
        compilable=list(platforms.compilable()),
        target=kernels(on_target),
        host=kernels(on_host),
        memory=targets.memory(on_target),
        warnings=[str(w.message) for w in caught if "triton" in str(w.message).lower()],
        module=module_choice(target) if module else None,
    )


def module_choice(target: str) -> dict:
    """A bfloat16 Attention module's training step compiled for `target` from this host: the
    compute dtype of each op call, per platform kind (the module's cast decided for the target)."""
    x = jax.ShapeDtypeStruct((4, 64, 64), jnp.bfloat16)
    mask = jax.ShapeDtypeStruct((4, 1, 1, 64), jnp.bool_)
    bias = jax.ShapeDtypeStruct((4, 64, 64), jnp.bfloat16)
    fn = hk.without_apply_rng(
        hk.transform(lambda x, mask, bias: ga.Attention(dict(num_head=4), {}, 64)(x, x, mask, bias))
    )
    params = jax.eval_shape(fn.init, jax.random.PRNGKey(0), x, mask, bias)

    def step(params, x, mask, bias, cotangent):
        _, vjp = jax.vjp(lambda p, x: fn.apply(p, x, mask, bias), params, x)
        return vjp(cotangent)

    with ga.record_implementation_choices() as record:
        targets.compile(step, params, x, mask, bias, x, target=target)
    return dict(
        calls=[{k: v["compute_dtype"] for k, v in r["by_platform"].items()} for r in record]
    )


def triangle_op_memory(target: str, n_res: int) -> dict:
    """The op's gradient at a triangle's shapes ([N, N, 4, 32] bfloat16, a shared [1, 4, N, N]
    bias, a key mask, the cotangent an argument) under 'auto', compiled for `target`."""
    dt = jnp.bfloat16
    qkv = jax.ShapeDtypeStruct((n_res, n_res, 4, 32), dt)
    bias = jax.ShapeDtypeStruct((1, 4, n_res, n_res), dt)
    mask = jax.ShapeDtypeStruct((n_res, 1, 1, n_res), jnp.bool_)

    def step(q, k, v, bias, mask, cotangent):
        fwd = lambda q, k, v, bias: ga.dot_product_attention(q, k, v, bias, mask)
        _, vjp = jax.vjp(fwd, q, k, v, bias)
        return vjp(cotangent)

    with ga.record_implementation_choices() as record:
        compiled = targets.compile(step, qkv, qkv, qkv, bias, mask, qkv, target=target)
    kind = targets.target(target).kind
    return dict(chosen=record[0]["by_platform"][kind]["chosen"], memory=targets.memory(compiled))


def kernel_cases(target: str, cases: list[dict]) -> list[dict]:
    """pallas_triton.kernel_stats for several cases in one process (the compilers start once);
    only the first where its compile dumps no PTX to read (jax 0.12: the rest would say nothing)."""
    from gated_attention_tools.kernel_matrix import pallas_triton

    first = pallas_triton.kernel_stats(target, **cases[0])
    if not first["ptx_files"]:
        return [first]
    return [first, *(pallas_triton.kernel_stats(target, **case) for case in cases[1:])]


def transposed_on_a_mesh(target: str) -> dict:
    """A [64, 64] bfloat16 array split along its rows over 8 devices of `target`, transposed and
    split along its rows again (so its columns move), compiled deviceless."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = targets.mesh(target, (8,), ("rows",))
    x = jax.ShapeDtypeStruct((64, 64), jnp.bfloat16, sharding=NamedSharding(mesh, P("rows")))
    with jax.set_mesh(mesh):
        compiled = jax.jit(lambda x: jax.sharding.reshard(x.T, P("rows"))).lower(x).compile()
    return dict(
        devices=mesh.size,
        kinds=sorted({d.device_kind for d in mesh.devices.flat}),
        collectives=targets.collectives(compiled),
    )


def auto_kernels(
    target: str, dtype: str, head_dim: int, bias: str, mask: str, batch: int = 2, seq: int = 200
) -> dict:
    """The op under 'auto' (no implementation named) compiled for a GPU `target`: its forward, and
    a training step (a loss's value and gradient in q, k, v and the bias). Per program: what
    'auto' chose for the GPU and the host and why, whether a Triton kernel is in the compiled
    program, and ptxas's figures for each of its kernels (pallas_triton.ptx_kernels: registers,
    spills, MMA). `bias`: 'shared' ([1, N, T, S]), 'per_row' ([B, N, T, S]) or 'none'; `mask`:
    'key' ([B, 1, 1, S]) or 'none'."""
    import glob
    import os
    import tempfile

    from gated_attention_tools.kernel_matrix import pallas_triton

    dt = jnp.dtype(dtype)
    heads = 4
    qkv = jax.ShapeDtypeStruct((batch, seq, heads, head_dim), dt)
    bias_shape = dict(shared=(1, heads, seq, seq), per_row=(batch, heads, seq, seq))
    biases = [jax.ShapeDtypeStruct(bias_shape[bias], dt)] if bias != "none" else []
    mask_spec = jax.ShapeDtypeStruct((batch, 1, 1, seq), jnp.bool_) if mask == "key" else None

    def forward(q, k, v, biases, mask):
        return ga.dot_product_attention(q, k, v, list(biases) or None, mask)

    def training(q, k, v, biases, mask):
        loss = lambda *x: jnp.mean(jnp.square(forward(*x, mask).astype(jnp.float32)))
        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q, k, v, biases)

    arch = targets.target(target).arch
    found = {}
    for name, fn in (("forward", forward), ("training", training)):
        with tempfile.TemporaryDirectory() as dump, ga.record_implementation_choices() as record:
            compiled = targets.compile(
                fn, qkv, qkv, qkv, tuple(biases), mask_spec, target=target, dump_to=dump
            )
            kernels = pallas_triton.ptx_kernels(dump, arch)
            ptx_files = len(glob.glob(os.path.join(dump, "*.ptx")))
        found[name] = dict(
            by_platform=record[0]["by_platform"],
            calls=len(record),
            triton="__gpu$xla.gpu.triton" in compiled.as_text(),
            kernels=kernels,
            ptx_files=ptx_files,
            memory=targets.memory(compiled),
        )
    return found


def each(function: str, cases: list[dict]) -> list:
    """function(**case) ('module:function', or a name here) for every case, in this one process:
    the compilers, the CUDA plugin and libtpu start once for all of them."""
    module, _, name = function.rpartition(":")
    fn = getattr(importlib.import_module(module), name) if module else globals()[name]
    return [fn(**case) for case in cases]
