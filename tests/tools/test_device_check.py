"""The device run: scripts/device_check.py end to end on CPU (the device tests skipped with their
reason, the benchmark's pipeline with the kernels interpreted), the benchmark's goals, budget and
peak memory, and scripts/device_wheels.py (no timing is asserted: speed lives in benchmark output)."""

import importlib.metadata
import importlib.util
import json
import pathlib
import re
import subprocess
import sys
import time

import jax.numpy as jnp
import pytest

from gated_attention_tools import child, device_benchmark, measure
from tests.helpers import benchmark_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import device_wheels  # noqa: E402  (scripts/ is not a package)


def test_device_check_runs_end_to_end_on_cpu(tmp_path):
    """The one device command on CPU: the device tests collected and skipped with the reason, the
    benchmark's op and module cells (kernels interpreted; what needs a GPU says so), each call's
    peak memory from a child process, the goals not judged off a device, and the summary."""
    # Suite time: 'auto' stands for ours (the interpreted kernels' compile costs seconds).
    variants = ("auto", "cudnn", "jax_nn_xla", "ours", "af2")
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "device_check.py"),
            "--smoke",
            f"--out={tmp_path}",
            "--tests=tests/attention/test_cudnn.py",
            "--workers=1",
            "--benchmark_flag=--config.modes=('forward_backward',)",
            f"--benchmark_flag=--config.variants={variants!r}",
            "--benchmark_flag=--config.device_memory=False",  # suite time: peaks() tested below
        ],  # fmt: skip
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert {p.name for p in tmp_path.iterdir()} >= {
        "tests.log", "tests.xml", "results.json", "results.md", "summary.md",
    }  # fmt: skip
    summary = (tmp_path / "summary.md").read_text()
    assert f"[device_check] wrote {tmp_path.resolve()}: " in result.stdout  # the path it wrote
    assert re.search(r"exit code 0; skipped [1-9]", summary), summary
    assert "x runs the compiled kernels on a GPU; the backend here is 'cpu'" in summary
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["environment"]["backend"] == "cpu"
    assert results["environment"]["command"].startswith(str(ROOT / "scripts" / "benchmark.py"))
    rows = {(r["level"], r["variant"]): r for r in results["cells"]}
    assert set(rows) == {(lv, v) for lv, vs in device_benchmark.VARIANTS.items() for v in vs
                         if v in variants}  # fmt: skip
    for key in (("op", "auto"), ("op", "jax_nn_xla"), ("module", "ours"), ("module", "af2")):
        row = rows[key]
        assert row["time_ms"] > 0 and row["finite"] and row["rel_diff_vs_float32"] < 1e-5, row
        assert row["xla_peak_mib"] > 0, row
    assert rows["op", "auto"]["chosen"] == ["xla"]
    assert rows["op", "jax_nn_xla"]["ratio_to_baseline"] == rows["module", "af2"][
        "ratio_to_baseline"
    ] == 1.0  # fmt: skip
    assert "GPU only" in rows["op", "cudnn"]["unavailable"]
    [goal] = results["goals"]
    assert goal["ratio"] > 0 and goal["met"] is None and "backend is 'cpu'" in goal["note"]
    assert (
        "| op | tiny 2x32 h2x16 | float32 | forward_backward | auto (xla) |"
        in (tmp_path / "results.md").read_text()
    )


def _rows(pairs):
    return [
        dict(level="op", shape="s", dtype="bfloat16", mode="forward", variant=v, rounds_ms=ms)
        for v, ms in pairs
    ]


def test_goals_are_judged_per_round_and_only_on_a_device():
    rows = _rows([("auto", [1.0, 2.0, 3.0]), ("jax_nn_xla", [4.0, 2.0, 6.0])])
    rows.append(dict(level="op", shape="s", dtype="bfloat16", mode="forward",
                     variant="jax_nn_cudnn", unavailable="runs on GPU only"))  # fmt: skip
    goals = [
        ("op", "s", "bfloat16", "forward", "auto", "jax_nn_xla", 0.5),
        ("op", "s", "bfloat16", "forward", "auto", "jax_nn_xla", 0.4),
        ("op", "s", "bfloat16", "forward", "auto", "jax_nn_cudnn", 1.0),
    ]
    met, missed, untimed = device_benchmark.judge_goals(goals, rows, "gpu")
    assert met["ratio"] == 0.5 and met["met"] is True  # per-round ratios 0.25, 1.0, 0.5
    assert missed["met"] is False
    assert untimed["ratio"] is None and untimed["note"] == "not timed: runs on GPU only"
    [off_device, *_] = device_benchmark.judge_goals(goals, rows, "cpu")
    assert off_device["ratio"] == 0.5 and off_device["met"] is None


def _config(preset="device_smoke", **overrides):
    return benchmark_config(preset, **overrides)


def test_a_spent_budget_runs_no_cell_and_says_so():
    timed = device_benchmark.time_cells(_config().to_dict(), seconds=0.0)
    assert timed["rows"] and not any("time_ms" in r for r in timed["rows"])
    assert all(r["unavailable"] == "not run: the time budget was spent" for r in timed["rows"])


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(variants=("pallas", "flash")), r"config.variants entries must be in .*got 'flash'"),
        (dict(levels=("op", "kernel")), r"config.levels entries must be in .*got 'kernel'"),
        (dict(goals=(("op", "tiny 2x32 h2x16", "bfloat16", "forward", "auto", "jax_nn_xla", 1),)),
         "names a cell the config does not run"),
    ],
)  # fmt: skip
def test_bad_configs_are_refused_before_anything_runs(overrides, match):
    with pytest.raises(ValueError, match=match):
        device_benchmark.run(_config(**overrides))


def test_peaks_measures_each_call_in_order_with_its_cells_inputs():
    """device_benchmark.peaks (the peak-memory children's target), in this process: calls of two
    cells in the order given, each cell's inputs made when a call needs them."""
    shape = ("tiny 2x32 h2x16", 2, 32, 2, 16)
    cells = [
        device_benchmark.Cell("op", device_benchmark.OpShape(*shape), "float32", m).as_dict()
        for m in ("forward", "forward_backward")
    ]
    calls = [[cells[0], "jax_nn_xla"], [cells[1], "xla"], [cells[0], "xla"]]
    got = device_benchmark.peaks(calls)
    assert len(got) == 3
    inputs_mib = (3 * 2 * 32 * 2 * 16 * 4 + 2 * 32 * 32 * 4 + 2 * 32) / 2**20  # q, k, v, bias, mask
    for peak in got:
        assert peak["exact"] and peak["peak_mib"] >= inputs_mib and peak["added_mib"] >= 0, peak


def test_call_peak_counts_what_the_call_allocates():
    n = 2**24  # 64 MiB of float32
    peak, out = measure.call_peak(lambda: jnp.ones((n,), jnp.float32) * 2.0)
    assert out.shape == (n,) and peak["exact"]
    assert 0.9 * 4 * n <= peak["added_bytes"] <= 4 * 4 * n, peak


def test_a_child_past_its_time_is_killed():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"killed after its 2 s"):
        child.call("subprocess:run", dict(args=["sleep", "60"]), timeout_s=2.0)
    assert time.monotonic() - start < 30


def test_device_wheels_are_the_pinned_ones_for_python_312(tmp_path):
    cmd = device_wheels.command(str(tmp_path))
    assert cmd[cmd.index("--python-version") + 1] == "3.12"
    assert {"--no-deps", "--only-binary=:all:"} <= set(cmd) and cmd[-len(device_wheels.WHEELS):] \
        == list(device_wheels.WHEELS)  # fmt: skip
    assert "manylinux_2_28_x86_64" in cmd and "manylinux2014_x86_64" in cmd
    pins = dict(w.split("==") for w in device_wheels.WHEELS)
    for name in ("alphafold-colabfold", "colabfold-kernels", "dm-haiku", "ml-collections"):
        assert name in pins  # the test extra pins AF2's two; the others as installed here
    for name in ("alphafold-colabfold", "colabfold-kernels"):
        assert pins[name] == importlib.metadata.version(name)
    for wheel in device_wheels.WHEELS:
        name, version = wheel.split("==")
        (tmp_path / f"{name.replace('-', '_')}-{version}-py3-none-any.whl").touch()
    assert device_wheels.check(tmp_path) == []
    (tmp_path / "dm_haiku-0.0.17-py3-none-any.whl").unlink()
    (tmp_path / "jmp-0.0.3-py3-none-any.whl").touch()
    assert device_wheels.check(tmp_path) == [
        "dm-haiku==0.0.17: found nothing",
        "jmp==0.0.4: found ['jmp-0.0.3-py3-none-any.whl', 'jmp-0.0.4-py3-none-any.whl']",
    ]


def test_device_wheel_sets_fit_a_call_and_refuse_unknown_names(tmp_path):
    assert device_wheels.wheels(device_wheels.DEFAULT_SETS) == device_wheels.WHEELS
    both = device_wheels.wheels(("core", "cuequivariance", "core"))  # each wheel once
    assert len(both) == len(set(both)) and both[0] == "dm-haiku==0.0.17"
    assert any(w.startswith("cuequivariance-ops-jax-cu13==") for w in both)
    cmd = device_wheels.command(str(tmp_path), sets=("core", "tokamax"))
    assert cmd[-len(device_wheels.wheels(("core", "tokamax"))) :][-1] == "six==1.17.0"
    with pytest.raises(ValueError, match=r"--sets must name sets of .*got \['tokamx'\]"):
        device_wheels.wheels(("core", "tokamx"))
    for wheel in device_wheels.wheels(("core",)):
        name, version = wheel.split("==")
        (tmp_path / f"{name.replace('-', '_')}-{version}-py3-none-any.whl").touch()
    assert device_wheels.check(tmp_path, ("core",)) == []
    with open(tmp_path / "dm_tree-0.1.10-py3-none-any.whl", "wb") as f:
        f.truncate(61 * 2**20)  # sparse: more than a call carries
    assert device_wheels.check(tmp_path, ("core",)) == [
        "61.0 MiB of wheels, over the 60 MiB a device call carries"
    ]
