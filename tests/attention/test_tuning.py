"""'auto' on a GPU takes what a device run measured fastest (gated_attention/attention/tuning.json, written
by gated_attention_tools/tuning_table.py), per mode: PerMode runs one implementation for the
forward alone and another for a training step."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gated_attention as ga
from gated_attention.attention import per_mode, tuning
from gated_attention_tools import tuning_table
from tests import reference

ROOT = Path(__file__).resolve().parents[2]
H100 = "NVIDIA H100 80GB HBM3"


def test_the_table_is_what_the_device_runs_measured():
    results = json.loads((ROOT / "benchmark_results/device/h100/results.json").read_text())
    assert tuning.table()["H100"] == tuning_table.entries(results)
    assert tuning_table.device_name(H100) == "H100"


@pytest.mark.parametrize(
    "kind, dtype, head_dim, length, expected",
    [
        (H100, "bfloat16", 32, 384, dict(forward="pallas", training="mosaic")),
        (H100, "bfloat16", 16, 1024, dict(forward="pallas", training="mosaic")),
        (H100, "bfloat16", 32, 16384, dict(forward="pallas", training="cudnn")),
        (H100, "float32", 32, 384, dict(forward="mosaic", training="mosaic")),
        (H100, "bfloat16", 64, 384, None),  # no run measured head dim 64
        (H100, "float16", 32, 384, None),
        ("NVIDIA H200", "bfloat16", 32, 384, None),  # no run on an H200 yet
        (None, "bfloat16", 32, 384, None),
    ],
)
def test_lookup(kind, dtype, head_dim, length, expected):
    assert tuning.lookup(kind, jnp.dtype(dtype), head_dim, length) == expected


def _on(device_kind):
    gpu = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=1, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=gpu)
    return jax.sharding.use_abstract_mesh(mesh)


def test_auto_takes_the_measured_winner_per_mode_where_the_table_has_one():
    sd = jax.ShapeDtypeStruct
    q = sd((2, 96, 4, 32), jnp.bfloat16)
    bias, mask = sd((1, 4, 96, 96), jnp.bfloat16), sd((2, 1, 1, 96), jnp.bool_)
    choose = lambda q: ga.Auto().choose(
        q, q, q, (bias,), mask, compute_dtype=q.dtype, platform="gpu"
    )
    with _on(H100):
        impl, reason = choose(q)
        assert isinstance(impl, per_mode.PerMode), reason
        assert (impl.inference.name, impl.training.name) == ("pallas", "mosaic")
        assert reason.startswith(f"measured fastest on {H100}: pallas for inference, mosaic")
        wide, _ = choose(sd((2, 96, 4, 64), jnp.bfloat16))
        assert wide.name == "mosaic"  # no entry: the rules
    with _on("NVIDIA H200"):
        assert choose(q)[0].name == "mosaic"


class _Recording(ga.XlaAttention):
    """The XLA implementation, noting each trace of it (which mode ran what)."""

    def __init__(self, log, label):
        object.__setattr__(self, "log", log)
        object.__setattr__(self, "label", label)

    def __call__(self, *args, **kwargs):
        self.log.append(self.label)
        return super().__call__(*args, **kwargs)


def test_per_mode_runs_one_for_inference_and_the_other_for_training():
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(2, 24, 2, 8)).astype(np.float32) for _ in range(3))
    bias = rng.normal(size=(1, 2, 24, 24)).astype(np.float32)
    mask = np.arange(24) < np.array([24, 15])[:, None, None, None]  # [2, 1, 1, 24]
    lengths = jnp.array([24, 20])
    log = []
    impl = per_mode.PerMode(_Recording(log, "inference"), _Recording(log, "training"))
    op = lambda q, k, v, b: ga.dot_product_attention(
        q, k, v, b, mask, implementation=impl, query_seq_lengths=lengths
    )
    out = jax.jit(op)(q, k, v, bias)
    assert log == ["inference"]
    cot = rng.normal(size=out.shape).astype(np.float32)
    log.clear()
    out2, vjp = jax.vjp(jax.jit(op), q, k, v, bias)
    grads = vjp(cot)
    assert log == ["training"]
    np.testing.assert_allclose(out2, out, atol=1e-6)
    want = reference.dot_product_attention(q, k, v, bias, mask)
    want[np.arange(24)[None, :] >= np.asarray(lengths)[:, None]] = 0.0  # jax.nn's lengths
    np.testing.assert_allclose(out, want, atol=1e-5)
    plain = lambda *a: ga.dot_product_attention(
        *a, mask, implementation="xla", query_seq_lengths=lengths
    )
    plain = jax.vjp(plain, q, k, v, bias)[1](cot)
    for got, expected in zip(grads, plain, strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-5)
    assert impl.name == "xla (inference), xla (training)"
