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
from gated_attention.attention import candidates, per_mode, tuning
from gated_attention_tools import tuning_table
from tests import reference

ROOT = Path(__file__).resolve().parents[2]
H100 = "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize(
    "device, run", [("H100", "h100/results.json"), ("H200", "h200/sweep/results.json")]
)
def test_the_table_is_what_the_device_runs_measured(device, run):
    results = json.loads((ROOT / "benchmark_results/device" / run).read_text())
    assert tuning.table()[device] == tuning_table.entries(results)
    assert tuning_table.device_name(results["environment"]["device_kind"]) == device


@pytest.mark.parametrize(
    "kind, dtype, head_dim, length, expected",
    [
        (H100, "bfloat16", 32, 384, dict(forward="pallas", training="mosaic")),
        (H100, "bfloat16", 16, 1024, dict(forward="pallas", training="mosaic")),
        (H100, "bfloat16", 32, 16384, dict(forward="pallas", training="cudnn")),
        (H100, "float32", 32, 384, dict(forward="mosaic", training="mosaic")),
        (H100, "bfloat16", 64, 384, None),  # no run measured head dim 64
        (H100, "float16", 32, 384, None),
        ("NVIDIA H200", "float16", 32, 384, None),  # its sweep timed bfloat16 and float32
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
    with _on("NVIDIA H200"):  # its sweep (2026-11-28): Mosaic's candidates with a shared bias
        impl, reason = choose(q)
        assert impl.inference == ga.MosaicAttention(block_k=64, rows_per_program=1), reason
        assert impl.training == ga.MosaicAttention(block_k=128, rows_per_program=2), reason
        assert reason.startswith("measured fastest on NVIDIA H200: mosaic:bk64,r1 for inference")


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


def _sweep_row(shape, dtype, mode, name, time_ms, head_dim=32, bias=True, accurate=True):
    """A row of a sweep's results.json (gated_attention_tools/sweep.py) for one candidate."""
    c = candidates.candidate(*_parse(name))
    dims = dict(name=shape, batch=2, length=384, num_head=4, head_dim=head_dim, bias=bias,
                mask=True)  # fmt: skip
    return dict(
        level="op", shape=shape, dtype=dtype, mode=mode, shape_dims=dims, variant=c.name,
        implementation=c.implementation, options=c.as_dict(), time_ms=time_ms,
        rel_diff_vs_float32=0.01, accurate=accurate,
    )  # fmt: skip


def _parse(name):
    """'pallas:bq32,bk64' -> ('pallas', {block_q: 32, block_k: 64}) for this test's names."""
    impl, _, spelled = name.partition(":")
    labels = {v: k for k, v in type(ga.IMPLEMENTATIONS[impl]).CANDIDATE_FIELDS.items()}
    options = {}
    for part in filter(None, spelled.split(",")):
        label = part.rstrip("0123456789")
        options[labels[label]] = int(part[len(label) :])
    return impl, options


FWD, TRAIN = "forward", "forward_backward"


def _synthetic_sweep():
    """Two bfloat16 shapes at head dim 32 with a shared bias, one without a bias, one at head dim
    8: per group the candidate of the least geometric mean of time over the fastest wins."""
    rows = []
    for shape, scale in (("msa_row", 1.0), ("triangle", 3.0)):
        for name, fwd, train in (
            ("pallas:bq64,bk64,w4,s2,r2", 1.0, 3.0),
            ("pallas:bq32,bk64,w4,s2,r2", 0.8, 3.5),  # fastest forward in both shapes
            ("mosaic:bk64", 1.1, 2.5),  # fastest training step in both
            ("mosaic:bk128", 0.5, 2.0),  # fastest, but its results disagreed: out
            ("xla", 4.0, 9.0),
        ):
            ok = not name.endswith("bk128")
            rows.append(_sweep_row(shape, "bfloat16", FWD, name, fwd * scale, accurate=ok))
            rows.append(_sweep_row(shape, "bfloat16", TRAIN, name, train * scale, accurate=ok))
    for mode, best in ((FWD, "pallas:bq64,bk32,w8,s1,r1"), (TRAIN, "cudnn")):
        rows.append(_sweep_row("msa_column", "bfloat16", mode, best, 1.0, bias=False))
        rows.append(_sweep_row("msa_column", "bfloat16", mode, "xla", 2.0, bias=False))
    for mode in (FWD, TRAIN):
        rows.append(_sweep_row("extra_msa", "bfloat16", mode, "pallas:bq128,bk64", 1.0, 8))
        rows.append(_sweep_row("extra_msa", "bfloat16", mode, "mosaic:bk64", 1.5, 8))
    not_run = _sweep_row("triangle", "bfloat16", FWD, "cudnn", 0.1)  # listed, never timed
    del not_run["time_ms"]
    env = dict(device_kind=H100, jax="0.11.2", date_utc="2026-12-01T00:00:00+00:00")
    return dict(environment=env, cells=[*rows, not_run])


def test_a_sweep_writes_options_that_auto_builds_on_that_device(
    tmp_path, monkeypatch, cudnn_loadable
):
    """A synthetic sweep's results -> the table file tuning_table writes -> 'auto' on a
    (deviceless) H100 builds each mode's winner with its options, per shape class."""
    results = tmp_path / "results.json"
    results.write_text(json.dumps(_synthetic_sweep()))
    table = tmp_path / "tuning.json"
    tuning_table.main(["tuning_table", str(results), f"--out={table}"])
    written = json.loads(table.read_text())
    assert written["H100"] != tuning.table()["H100"]  # replaced; the package's file untouched
    by = {(e["mode"], e["max_head_dim"], e["bias"]): e for e in written["H100"]}
    assert set(by) == {(m, d, b) for m in tuning.MODES for d, b in ((32, "shared"),
                       (32, "none"), (8, "shared"))}  # fmt: skip
    assert by["forward", 32, "shared"]["candidate"] == "pallas:bq32,bk64,w4,s2,r2"
    assert by["forward", 32, "shared"]["options"] == dict(
        block_q=32, block_k=64, num_warps=4, num_stages=2, rows_per_program=2
    )
    assert by["training", 32, "shared"] | dict(measured="") == dict(
        dtype="bfloat16", mode="training", long=False, max_head_dim=32, bias="shared",
        implementation="mosaic", candidate="mosaic:bk64", options=dict(block_k=64), measured="",
    )  # fmt: skip
    assert by["training", 32, "none"]["candidate"] == "cudnn"
    monkeypatch.setattr(tuning, "TABLE_FILE", table)
    tuning.table.cache_clear()
    try:
        sd = jax.ShapeDtypeStruct
        mask = sd((2, 1, 1, 96), jnp.bool_)

        def choose(head_dim, bias=True, auto=None):
            q = sd((2, 96, 4, head_dim), jnp.bfloat16)
            biases = (sd((1, 4, 96, 96), jnp.bfloat16),) if bias else ()
            auto = auto or ga.Auto()
            return auto.choose(q, q, q, biases, mask, compute_dtype=q.dtype, platform="gpu")

        with _on(H100):
            impl, reason = choose(32)
            assert impl.inference == ga.PallasAttention(
                block_q=32, block_k=64, num_warps=4, num_stages=2, rows_per_program=2
            )
            assert impl.training == ga.MosaicAttention(block_k=64)
            assert reason.startswith(
                f"measured fastest on {H100}: pallas:bq32,bk64,w4,s2,r2 for inference, "
                "mosaic:bk64 for training"
            )
            impl, _ = choose(32, bias=False)  # the class without a bias: its own entries
            assert impl.inference == ga.PallasAttention(
                block_q=64, block_k=32, num_warps=8, num_stages=1, rows_per_program=1
            )
            assert impl.training.name == "cudnn"
            impl, _ = choose(8)  # head dim 8: its own entries, one candidate for both modes
            assert impl == ga.PallasAttention(block_q=128, block_k=64)
            impl, _ = choose(16)  # head dim 16: the least class that holds it, 32's
            assert impl.inference.block_q == 32
            tuned = ga.Auto(pallas=ga.PallasAttention(block_q=16))  # the caller's tuning stays
            assert choose(32, auto=tuned)[0].inference.block_q == 16
            assert choose(64)[0].name == "mosaic"  # no entry: the rules
    finally:
        tuning.table.cache_clear()


def test_every_entry_builds_and_bad_classes_are_refused():
    for entries in tuning.table().values():
        for e in entries:  # legacy entries: the instance as it is
            candidates.candidate(e["implementation"], e.get("options")).build()
    with pytest.raises(ValueError, match=r"bias must be one of .* or None, got 'pair'"):
        tuning.choice(H100, jnp.dtype("bfloat16"), 32, 384, "pair")
