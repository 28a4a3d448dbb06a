"""The hardware floor of a device cell (gated_attention_tools/floor.py) and the per-level summary
the README quotes from a device run (gated_attention_tools/device_summary.py)."""

import pytest

from gated_attention_tools import device_benchmark, device_summary, floor

H100 = "NVIDIA H100 80GB HBM3"
MSA_ROW = dict(name="msa_row", batch=512, length=384, num_head=8, head_dim=32, bias=True, mask=True)


def test_floor_of_the_msa_row_forward_on_an_h100():
    scores = 512 * 8 * 384 * 384
    got = floor.floor(MSA_ROW, "bfloat16", "forward", H100)
    # 16 exponentials per SM per clock on 132 SMs at 1.83 GHz; 4,096 bf16 FLOP per SM per clock.
    assert got["exp_ms"] == pytest.approx(1e3 * scores / (16 * 132 * 1.83e9))
    assert got["exp_ms"] == pytest.approx(0.156, abs=1e-3)
    assert got["mma_ms"] == pytest.approx(1e3 * 4 * 32 * scores / (4096 * 132 * 1.83e9))
    qkvo, bias, mask = 4 * 512 * 384 * 8 * 32 * 2, 8 * 384 * 384 * 2, 512 * 384
    assert got["hbm_ms"] == pytest.approx(1e3 * (qkvo + bias + mask) / 3.35e12)
    assert (got["bound"], got["floor_ms"]) == ("exp", got["exp_ms"])


def test_floor_follows_mode_dtype_device_and_level():
    fwd = floor.floor(MSA_ROW, "bfloat16", "forward", H100)
    train = floor.floor(MSA_ROW, "bfloat16", "forward_backward", H100)
    assert train["exp_ms"] == pytest.approx(2 * fwd["exp_ms"])  # the backward rebuilds P once
    assert train["mma_ms"] == pytest.approx(14 / 4 * fwd["mma_ms"])  # 320 FLOPs a score at H 32
    f32 = floor.floor(MSA_ROW, "float32", "forward", H100)
    assert f32["mma_ms"] == pytest.approx(2 * fwd["mma_ms"])  # TF32 at half bf16's rate
    h200 = floor.floor(MSA_ROW, "bfloat16", "forward", "NVIDIA H200")
    assert h200["hbm_ms"] == pytest.approx(fwd["hbm_ms"] * 3.35 / 4.8)
    assert h200["exp_ms"] == pytest.approx(fwd["exp_ms"])
    module = floor.floor(MSA_ROW, "bfloat16", "forward", H100, level="module")
    assert module["mma_ms"] > fwd["mma_ms"]  # the projections
    assert floor.floor(MSA_ROW, "bfloat16", "forward", "NVIDIA A100-SXM4-80GB") is None
    assert floor.floor(MSA_ROW, "bfloat16", "forward", "cpu") is None


def _row(variant, ms, shape="msa_row 512x384 h8x32", mode="forward", level="op", dims=MSA_ROW):
    return dict(level=level, shape=shape, dtype="bfloat16", mode=mode, variant=variant,
                time_ms=ms, shape_dims=dims)  # fmt: skip


def _results(cells):
    env = dict(device_kind=H100, jax="0.11.2", date_utc="2026-11-26T14:54:36+00:00", backend="gpu")
    env["command"] = "scripts/benchmark.py"
    return dict(environment=env, cells=cells)


def test_summary_table_ranges_over_af2_shapes_and_says_what_was_not_measured():
    tri = dict(MSA_ROW, name="triangle", batch=1024, length=1024, num_head=4)
    cells = [
        _row("auto", 1.5),
        _row("af2_colabfold", 1.0),
        _row("auto", 6.0, shape="triangle 1024 h4x32", dims=tri),
        _row("af2_colabfold", 5.0, shape="triangle 1024 h4x32", dims=tri),
        _row("jax_nn_cudnn", 3.0),
        _row("auto", 4.0, mode="forward_backward"),
        _row("af2_colabfold", 8.0, mode="forward_backward"),
        dict(_row("jax_nn_xla", None), unavailable="out of memory"),  # not timed
        dict(_row("auto", 2.0), dtype="float32"),  # bfloat16 cells only
    ]
    lines = device_summary.table(_results(cells)).splitlines()
    assert lines[0].startswith(f"Measured on one {H100} (jax 0.11.2, 2026-11-26)")
    colab = next(line for line in lines if line.startswith("| attention alone, against ColabFold"))
    assert colab.split(" | ")[1:] == ["1.20-1.50x", "0.50x", "not measured", "not measured |"]
    cudnn = next(
        line for line in lines if line.startswith("| attention alone, against jax.nn's cuDNN")
    )
    assert cudnn.split(" | ")[1:3] == ["0.50x", "not measured"]
    xla = next(line for line in lines if line.startswith("| attention alone, against jax.nn's XLA"))
    assert xla.split(" | ")[1] == "not measured"
    share = next(line for line in lines if "peak rate it reaches" in line)
    fwd = floor.floor(MSA_ROW, "bfloat16", "forward", H100)["floor_ms"]
    low = min(100 * fwd / 1.5, 100 * floor.floor(tri, "bfloat16", "forward", H100)["floor_ms"] / 6)
    assert share.split(" | ")[1].startswith(f"{low:.0f}-")


def test_update_rewrites_the_marked_table(tmp_path):
    run = tmp_path / "runs" / "h100"
    run.mkdir(parents=True)
    results = _results([_row("auto", 1.5), _row("af2_colabfold", 1.0)])
    (run / "results.json").write_text(__import__("json").dumps(results))
    page = tmp_path / "page.md"
    page.write_text(
        "Intro.\n\n<!-- device-summary: h100 -->\nOLD-CAPTION\n\n| OLD-ROW |\n| --- |\n\nAfter.\n"
    )
    assert device_summary.update(page, tmp_path / "runs")
    text = page.read_text()
    assert device_summary.table(results) in text and "OLD" not in text
    assert text.startswith("Intro.\n") and text.endswith("\n\nAfter.\n")
    assert not device_summary.update(page, tmp_path / "runs")  # already current


def test_results_rows_carry_their_floor_in_the_table():
    row = dict(_row("auto", 1.5), chosen=["mosaic"], rel_diff_vs_float32=1e-3, finite=True,
               xla_temp_mib=8.0)  # fmt: skip
    table = device_benchmark.markdown(_results([row]))
    line = next(x for x in table.splitlines() if x.startswith("| op |"))
    fwd = floor.floor(MSA_ROW, "bfloat16", "forward", H100)
    assert line.endswith(f"| {fwd['floor_ms']:.3g} (exp) | {100 * fwd['floor_ms'] / 1.5:.1f} |")


@pytest.mark.parametrize(
    "variant, package",
    [
        ("cuequivariance", "cuequivariance_jax"),
        ("tokamax_xla_chunked", "tokamax"),
        ("packed", "haiku"),
    ],
)
def test_peer_adapters_compute_the_op_and_its_gradients(variant, package):
    """The device benchmark's peers in their own layouts (cuEquivariance's [1, B, N, T, H] and
    float32 bias; tokamax as jax.nn): on CPU both run their JAX paths, so the adapters' layout is
    checked against jax.nn here, forward and gradients (q, k, v and the shared bias)."""
    pytest.importorskip(package)
    from absl import flags

    if not flags.FLAGS.is_parsed():  # tokamax reads its absl flags; pytest's argv is not theirs
        flags.FLAGS.mark_as_parsed()
    import jax
    import jax.numpy as jnp
    import numpy as np

    shape = device_benchmark.OpShape("t", 3, 24, 2, 16)
    args = device_benchmark.op_inputs(shape, "float32", "forward_backward")
    steps = {
        v: jax.jit(device_benchmark.op_step(device_benchmark.attention_fn(v, jnp.float32), mode))
        for v in (variant, "jax_nn_xla")
        for mode in ("forward_backward",)
    }
    fwd = {v: jax.jit(device_benchmark.attention_fn(v, jnp.float32)) for v in steps}
    np.testing.assert_allclose(fwd[variant](*args[:5]), fwd["jax_nn_xla"](*args[:5]), atol=1e-5)
    for got, want in zip(steps[variant](*args), steps["jax_nn_xla"](*args), strict=True):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_summary_ratios_are_the_results_files_ratios():
    """A ratio in the summary is the one results.md gives where the run has it (the median of the
    per-round ratios, not the ratio of the medians): the H100 run's module cell is 1.030 there
    (1.02 as a ratio of medians)."""
    import json
    import pathlib

    path = (
        pathlib.Path(__file__).resolve().parents[2] / "benchmark_results/device/h100/results.json"
    )
    results = json.loads(path.read_text())
    module = next(line for line in device_summary.table(results).splitlines()
                  if line.startswith("| AF2's Attention module"))  # fmt: skip
    [cell] = [c for c in results["cells"] if (c["level"], c["variant"], c.get("time_ms") is not None)
              == ("module", "ours", True)]  # fmt: skip
    assert f"{cell['ratio_to_baseline']:.3f}" == "1.030"
    assert module.split(" | ")[2] == f"{cell['ratio_to_baseline']:.2f}x" == "1.03x"
    rounds = [dict(_row("auto", 3.0), rounds_ms=[1.0, 3.0, 5.0]),
              dict(_row("af2_colabfold", 3.0), rounds_ms=[1.0, 1.0, 5.0])]  # fmt: skip
    colab = next(line for line in device_summary.table(_results(rounds)).splitlines()
                 if "ColabFold" in line)  # fmt: skip
    assert colab.split(" | ")[1] == "1.00x"  # per round 1, 3, 1: median 1 (medians: 3 / 1)


def test_summary_reads_the_run_folders_family_cells_and_leaves_out_wrong_ones(tmp_path):
    """load(): a run folder's family*/ cells give the modules' row (ours over ColabFold's AF2,
    median of per-round ratios); a peer further than WRONG from the reference is not compared."""
    import json

    wrong = dict(_row("tokamax_triton", 0.5), rel_diff_vs_float32=5.1)
    (tmp_path / "results.json").write_text(json.dumps(_results([_row("auto", 1.5), wrong])))
    for i, (variant, rounds) in enumerate([("ours", [2.0, 3.0, 4.0]), ("colabfold", [4.0] * 3)]):
        cell = dict(cell="msa_row 512x384", what="msa_row", dtype="bfloat16", mode="training",
                    variant=variant, time_ms=rounds[1], rounds_ms=rounds)  # fmt: skip
        (tmp_path / f"family{i}").mkdir()
        (tmp_path / f"family{i}" / "results.json").write_text(json.dumps(dict(cells=[cell])))
    lines = device_summary.table(device_summary.load(tmp_path)).splitlines()
    [modules] = [line for line in lines if line.startswith("| AF2's MSA row modules")]
    assert modules.split(" | ")[1:3] == ["not measured", "0.75x"]
    [tokamax] = [line for line in lines if "tokamax's Triton" in line]
    assert tokamax.split(" | ")[1] == "not measured"


def test_colabfolds_packed_adapter_hands_its_kernel_alphafolds_layout(monkeypatch):
    """af2_colabfold_packed gives ColabFold's packed kernel AF2's layout (p [B, T, 3, N, H], the
    nonbatched bias [N, T, S], kmask [B, S] True where kept): with the kernel swapped for the
    package's own reference (packed_attn.attention_via over a plain heads-major attention; the
    kernels run on a GPU only), the op and its gradients are jax.nn's."""
    pytest.importorskip("colabfold_kernels")
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    from colabfold_kernels import fused_ops
    from colabfold_kernels import packed_attn as pa

    def heads_major(q, k, v, mask_bias, bias, scale):  # [b, h, S, c], AF2's Attention einsums
        logits = jnp.einsum("bhqc,bhkc->bhqk", q * scale, k) + mask_bias
        logits = logits if bias is None else logits + bias[None]
        return jnp.einsum("bhqk,bhkc->bhqc", jax.nn.softmax(logits), v)

    reference = functools.partial(pa.attention_via, attention=heads_major)
    monkeypatch.setattr(device_benchmark, "_on_gpu", lambda what: None)
    monkeypatch.setattr(fused_ops, "packed_attention", lambda *a: reference)
    shape = device_benchmark.OpShape("t", 3, 24, 2, 16)
    args = device_benchmark.op_inputs(shape, "float32", "forward_backward")
    for mode, n in (("forward", 5), ("forward_backward", 6)):
        got, want = (
            jax.jit(device_benchmark.op_step(device_benchmark.attention_fn(v, jnp.float32), mode))(
                *args[:n]
            )
            for v in ("af2_colabfold_packed", "jax_nn_xla")
        )
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)
