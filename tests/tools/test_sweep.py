"""The sweep (gated_attention_tools/sweep.py): its preset's cells and budget, its smoke run end to
end on CPU (interpreted kernels: the results, the table 'auto' reads), refused configs."""

import contextlib
import importlib.util
import io
import json
import pathlib

import pytest

from gated_attention.attention import dispatch, tuning
from gated_attention_tools import suites, sweep
from tests.helpers import benchmark_config, benchmark_configs

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _config(preset="sweep_smoke", **overrides):
    return benchmark_config(preset, **overrides)


def test_the_preset_sweeps_afs_cells_bfloat16_first():
    cfg = _config("sweep")
    cells = sweep.cells(cfg)
    assert len(cells) == 7 * 2 * 2  # shapes x dtypes x modes
    assert [c.label for c in cells[:2]] == [
        "op msa_row 512x384 h8x32 bfloat16 forward_backward",
        "op msa_row 512x384 h8x32 bfloat16 forward",
    ]
    assert {c.dtype for c in cells[:14]} == {"bfloat16"} and cells[-1].shape.length == 2048
    dims = {c.shape.name: (c.shape.batch, c.shape.length, c.shape.num_head, c.shape.head_dim,
                           c.shape.bias) for c in cells}  # fmt: skip
    assert dims["extra_msa 5120x384 h8x8"] == (5120, 384, 8, 8, True)
    assert dims["msa_column 384x512 h8x32"] == (384, 512, 8, 32, False)
    assert dims["template 384 h4x16"] == (384, 384, 4, 16, True)
    counts = {c.shape.name: len(sweep.cell_candidates(c, (9, 0), cfg)) for c in cells[:14:2]}
    # Ours (18, 16 without a bias) and the 7 peers (tokamax's and ColabFold's, peers.py).
    assert counts == {
        "msa_row 512x384 h8x32": 25, "triangle 1024 h4x32": 25, "triangle 512 h4x32": 25,
        "extra_msa 5120x384 h8x8": 25, "msa_column 384x512 h8x32": 23,
        "template 384 h4x16": 25, "triangle 2048 h4x32": 25,
    }  # fmt: skip
    peers = [c.name for c in sweep.cell_candidates(cells[0], (9, 0), cfg)][-7:]
    assert tuple(peers) == dispatch.PEERS == benchmark_configs().PEERS
    # The forward cells leave out the one-pass backward's candidate: its forward is its twin's.
    forward = {c.shape.name: sweep.cell_candidates(c, (9, 0), cfg) for c in cells[1:14:2]}
    for name, found in forward.items():
        assert len(found) == counts[name] - 1 and not [c for c in found if ",f1" in c.name]
    # By field (every two-consumer Mosaic forward, the persistent one too) and by name.
    cfg.skip = ("c2", "xla")
    left = [c.name for c in sweep.cell_candidates(cells[0], (9, 0), cfg)]
    assert len(left) == 25 - 4 and not [c for c in left if ",c2" in c or c == "xla"]
    assert "mosaic:bk128,r2" in left  # a field's name is not a substring match


def test_the_smoke_run_writes_results_and_the_table(tmp_path):
    """The smoke preset end to end (one tiny cell, an H100's first candidates interpreted): each
    candidate timed and equal to the float32 reference, results.md, and tuning.json the
    package's table with this device's ('CPU') entries added."""
    results, table = suites.run(_config(), tmp_path, log=lambda line: None)
    assert {p.name for p in tmp_path.iterdir()} == {"results.json", "results.md", "tuning.json"}
    assert json.loads((tmp_path / "results.json").read_text()) == results
    assert results["capability"] == [9, 0] and results["environment"]["backend"] == "cpu"
    every = {r["variant"]: r for r in results["cells"]}
    assert list(every) == [
        "pallas:bq64,bk64,w8,s2,r1", "pallas:bq32,bk64,w8,s2,r1", "xla",
        # The peers an H100 takes at float32 (ColabFold's: half precision only): tokamax's
        # kernels GPU only, its XLA paths timed where tokamax is installed (Python >= 3.12).
        "tokamax_mosaic", "tokamax_triton", "tokamax_xla_chunked", "tokamax_xla",
    ]  # fmt: skip
    for name in ("tokamax_mosaic", "tokamax_triton"):  # ours refuses the CPU, tokamax the GPU's
        why = every[name]["unavailable"]  # branch here (its default device is the CPU)
        assert "runs on GPU only, the program is for 'cpu'" in why or "Not supported on cpu" in why
    tokamax = importlib.util.find_spec("tokamax") is not None
    for name in ("tokamax_xla_chunked", "tokamax_xla"):
        if not tokamax:
            assert "tokamax is not installed" in every[name]["unavailable"], every[name]
    rows = {n: r for n, r in every.items() if "unavailable" not in r}
    assert len(rows) == (5 if tokamax else 3), every
    for name, row in rows.items():
        assert row["time_ms"] > 0 and row["accurate"] and row["rel_diff_vs_float32"] < 1e-5, row
        assert row["implementation"] == name.partition(":")[0]
        assert row["temp_mib"] >= 0, row  # XLA's memory analysis of the candidate's program
    assert rows["pallas:bq32,bk64,w8,s2,r1"]["options"]["block_q"] == 32
    md = (tmp_path / "results.md").read_text()
    assert "| rel. diff | temp MiB |" in md
    assert min(r["ratio_to_fastest"] for r in rows.values()) == 1.0
    written = json.loads((tmp_path / "tuning.json").read_text())
    assert written["H100"] == tuning.table()["H100"]  # other devices' entries stay
    [entry] = written["CPU"]
    fastest = min(rows, key=lambda n: rows[n]["time_ms"])
    assert entry | dict(measured="") == dict(
        dtype="float32", mode="forward", long=False, max_head_dim=16, bias="shared",
        implementation=rows[fastest]["implementation"], candidate=fastest,
        options=rows[fastest]["options"], measured="",
    )  # fmt: skip
    assert f"| CPU | float32 | forward | 16 | shared | {fastest} |" in table


def test_a_spent_budget_runs_no_cell_and_lists_every_candidate():
    cfg = _config(dtypes=("float32", "bfloat16"), implementations=("mosaic", "pallas", "cudnn"))
    timed = sweep.time_cells(cfg.to_dict(), seconds=0.0)
    assert all(r["unavailable"] == "not run: the time budget was spent" for r in timed["rows"])
    assert [(r["dtype"], r["variant"]) for r in timed["rows"]] == [
        ("float32", "mosaic:bk64,r1"), ("float32", "mosaic:bk64,r2"),
        ("float32", "pallas:bq64,bk64,w8,s2,r1"),
        ("float32", "pallas:bq32,bk64,w8,s2,r1"),  # no cuDNN in float32
        ("bfloat16", "mosaic:bk128,r1"), ("bfloat16", "mosaic:bk128,r2"),
        ("bfloat16", "pallas:bq64,bk64,w4,s2,r2"), ("bfloat16", "pallas:bq32,bk64,w4,s2,r2"),
        ("bfloat16", "cudnn"),
    ]  # fmt: skip
    cfg = _config(dtypes=("float32", "bfloat16"))
    del cfg.tolerance["bfloat16"]
    with pytest.raises(ValueError, match="config.tolerance must name every dtype swept, got no"):
        sweep.run(cfg)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(capability="9"), r"config.capability must be '' .* or 'major.minor'.*got '9'"),
        (dict(dtypes=("float16",)), r"config.dtypes entries must be in .*got 'float16'"),
        (dict(implementations=("chunked",)), r"config.implementations entries .*got 'chunked'"),
        (dict(candidates_per_implementation=-1), r"must be >= 0 \(0: every candidate\), got -1"),
    ],
)
def test_bad_configs_are_refused_before_anything_runs(overrides, match):
    with pytest.raises(ValueError, match=match):
        sweep.run(_config(**overrides))


def test_a_candidate_that_does_not_build_is_a_row_with_the_reason(monkeypatch):
    """cuDNN refused here (no GPU) when its program is lowered, a Triton candidate's compile
    failing (as a kernel the device's compiler rejects): both rows say why, the rest is timed."""
    cfg = _config(dtypes=("bfloat16",), implementations=("pallas", "cudnn", "xla"))
    cfg.candidates_per_implementation = 1
    compile_all = sweep.device_benchmark._compile_all

    def failing(lowered, workers):
        out = compile_all(lowered, workers)
        out["forward", "pallas:bq64,bk64,w4,s2,r2"] = RuntimeError("ptxas: too many resources")
        return out

    monkeypatch.setattr(sweep.device_benchmark, "_compile_all", failing)
    [group] = sweep.groups(cfg)
    rows = {r["variant"]: r for r in sweep.run_group(group, cfg, (9, 0), log=lambda line: None)}
    assert rows["pallas:bq64,bk64,w4,s2,r2"]["unavailable"] == (
        "failed: RuntimeError: ptxas: too many resources"
    )
    assert "cuDNN attention runs on GPU only" in rows["cudnn"]["unavailable"]
    assert rows["xla"]["time_ms"] > 0 and rows["xla"]["accurate"]


def test_a_child_that_dies_leaves_the_groups_it_finished(monkeypatch):
    """The child's tagged lines (its environment, each group's rows as that group ends) are
    kept when it dies in a later group (a kernel that crashes the GPU): those rows as they were,
    every cell after them 'not run' with the child's error; dead before its first line: raised."""
    cfg = _config(dtypes=("float32", "bfloat16"), implementations=("pallas", "xla"))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        whole = sweep.time_cells(cfg.to_dict(), seconds=0.0)  # both groups, budget spent
    lines = printed.getvalue().splitlines()
    rows_lines = [x for x in lines if x.startswith("sweep-rows: ")]
    assert len(rows_lines) == 2  # one per group (float32, then bfloat16)
    error = RuntimeError("child failed: Segmentation fault")

    def dying(target, kwargs, log, env):
        for line in lines[: lines.index(rows_lines[1])]:  # dies in the second group
            log(line)
        raise error

    monkeypatch.setattr(sweep.child, "call", dying)
    results = sweep.run(cfg, log=lambda line: None)
    first = [r for r in whole["rows"] if r["dtype"] == "float32"]
    assert results["cells"][: len(first)] == first
    rest = results["cells"][len(first) :]
    assert [r["variant"] for r in rest] == [
        r["variant"] for r in whole["rows"] if r["dtype"] == "bfloat16"
    ]
    assert all(
        r["unavailable"]
        == "not run: the sweep's process died (failed: RuntimeError: child failed: "
        "Segmentation fault)"
        for r in rest
    ), rest[0]["unavailable"]
    assert results["capability"] == [9, 0]

    def dead_at_once(target, kwargs, log, env):
        raise error

    monkeypatch.setattr(sweep.child, "call", dead_at_once)
    with pytest.raises(RuntimeError, match="Segmentation fault"):
        sweep.run(cfg, log=lambda line: None)
