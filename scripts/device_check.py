r"""The one device command: the tests that run the compiled kernels, then the device benchmark,
within a time budget (8 minutes by default); what they find written to --out.

  python scripts/device_check.py --out=DIR            # on a GPU or TPU machine
  python scripts/device_check.py --smoke --out=DIR    # on CPU, a minute: the pipeline end to end
  python scripts/device_check.py --tests= --preset=peers --out=DIR  # the peers alone, no tests
  python scripts/device_check.py --tests= --preset=sweep --out=DIR --budget_s=290  # the sweep

1. `pytest -m device` (the implementation harness and the conformance scenarios on the compiled
   kernels, `pallas` and `cudnn` on a GPU, `pallas_tpu` on a TPU, against the float64 reference;
   elsewhere they skip and say why): DIR/tests.log and DIR/tests.xml (JUnit);
2. scripts/benchmark.py with configs/benchmark.py:device (--preset=peers: the op at AF2's shapes
   against every peer; --preset=sweep: every tuning candidate at AF2's cells, and DIR/tuning.json,
   the table 'auto' reads; :device_smoke or :sweep_smoke with --smoke) in the time left:
   DIR/results.json and DIR/results.md (time, peak memory and difference from float32 of
   each variant, the goals judged);
3. DIR/summary.md: the environment, this command, the tests' counts with every failure and each
   skip reason, the goals, and the time each step took.

On a machine without network, install the wheels scripts/device_wheels.py downloaded first (docs/gpu_tpu.md,
"The device run"). Exits 1 if a test failed or a step did not finish.
"""

import collections
import json
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

from absl import app, flags

ROOT = pathlib.Path(__file__).resolve().parents[1]

_OUT = flags.DEFINE_string("out", None, "Folder the results are written to.", required=True)
_BUDGET = flags.DEFINE_float("budget_s", 480.0, "Seconds the whole command may take.")
_TESTS_BUDGET = flags.DEFINE_float("tests_budget_s", 180.0, "Seconds the tests may take.")
_SMOKE = flags.DEFINE_bool("smoke", False, "The benchmark's device_smoke preset (CPU, seconds).")
_PRESET = flags.DEFINE_enum(
    "preset",
    "device",
    ["device", "peers", "sweep"],
    "configs/benchmark.py's preset the benchmark runs (with --smoke: device_smoke, or "
    "sweep_smoke for the sweep).",
)
_TESTS = flags.DEFINE_list("tests", ["tests"], "Test paths given to pytest -m device.")
_WORKERS = flags.DEFINE_integer(
    "workers", min(8, os.cpu_count() or 1), "pytest-xdist workers (compiling is the tests' cost)."
)
_BENCHMARK_FLAGS = flags.DEFINE_multi_string(
    "benchmark_flag", [], "A flag passed on to scripts/benchmark.py, e.g. --config.rounds=5."
)
# What the benchmark leaves unspent of its budget for its last cell to finish.
_MARGIN_S = 45.0


def run_tests(out: pathlib.Path, seconds: float) -> dict:
    """pytest -m device in a process group of its own, killed whole after `seconds`."""
    cmd = [
        sys.executable, "-m", "pytest", "-m", "device", "-n", str(_WORKERS.value),
        "-p", "no:cacheprovider", "-rfEs", f"--junitxml={out / 'tests.xml'}", *_TESTS.value,
    ]  # fmt: skip
    with open(out / "tests.log", "w") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            code = proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    return dict(exit_code=code, **junit(out / "tests.xml"))


def junit(path: pathlib.Path) -> dict:
    """Counts, failures (test and first line of the message) and skip reasons of a JUnit XML."""
    if not path.exists():
        return dict(counts={}, failures=[], skips={})
    counts, failures, skips = collections.Counter(), [], collections.Counter()
    for case in ET.parse(path).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        if outcome is None:
            counts["passed"] += 1
        elif outcome.tag == "skipped":
            counts["skipped"] += 1
            skips[outcome.get("message", "").removeprefix("Skipped: ")] += 1
        else:
            counts["failed" if outcome.tag == "failure" else "errors"] += 1
            message = (outcome.get("message") or outcome.text or "").strip().splitlines()
            failures.append(f"{name}: {message[0][:300] if message else ''}")
    return dict(counts=dict(counts), failures=failures, skips=dict(skips))


def run_benchmark(out: pathlib.Path, seconds: float) -> int:
    """scripts/benchmark.py's device preset with `seconds` of budget; its output goes to stdout."""
    preset = _PRESET.value
    if _SMOKE.value:
        preset = "sweep_smoke" if preset == "sweep" else "device_smoke"
    cmd = [
        sys.executable, str(ROOT / "scripts" / "benchmark.py"),
        f"--config={ROOT / 'configs' / 'benchmark.py'}:{preset}", f"--config.output_dir={out}",
        f"--config.time_budget_s={max(1.0, seconds)}", *_BENCHMARK_FLAGS.value,
    ]  # fmt: skip
    print("$ " + shlex.join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT).returncode


def summary(out: pathlib.Path, tests: dict, bench_code: int, steps: dict) -> str:
    results = out / "results.json"
    results = json.loads(results.read_text()) if results.exists() else {}
    env = results.get("environment", {})
    lines = [
        f"# Device check: {env.get('device_kind', '?')} ({env.get('backend', '?')}), "
        f"jax {env.get('jax', '?')}, Python {env.get('python', '?')}, {env.get('date_utc', '?')}",
        "",
        f"Command: `{shlex.join([sys.executable, *sys.argv])}`",
        "",
        "Steps (seconds): " + ", ".join(f"{k} {v:.0f}" for k, v in steps.items()),
        "",
        "## Tests (`pytest -m device`)",
        "",
        "exit code " + ("(killed: out of time)" if tests["exit_code"] is None else
                        str(tests["exit_code"])) + "; "
        + (", ".join(f"{k} {v}" for k, v in sorted(tests["counts"].items())) or "no results"),
    ]  # fmt: skip
    lines += ["", *(f"- FAILED {f}" for f in tests["failures"])] if tests["failures"] else []
    if tests["skips"]:
        lines += ["", "Skipped:", *(f"- {n} x {reason}" for reason, n in tests["skips"].items())]
    lines += ["", f"## Benchmark (exit code {bench_code}): results.md", ""]
    for goal in results.get("goals", []):
        met = {True: "met", False: "MISSED", None: goal.get("note", "")}[goal["met"]]
        ratio = "-" if goal["ratio"] is None else f"{goal['ratio']:.3f}"
        lines.append(
            f"- {goal['level']} {goal['shape']} {goal['dtype']} {goal['mode']}: "
            f"{goal['variant']} / {goal['against']} = {ratio} (at most {goal['max_ratio']}): {met}"
        )
    return "\n".join(lines) + "\n"


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    start = time.monotonic()
    out = pathlib.Path(_OUT.value).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    print(
        f"[device_check] tests: pytest -m device (at most {_TESTS_BUDGET.value:.0f} s)", flush=True
    )
    if _TESTS.value:
        tests = run_tests(out, min(_TESTS_BUDGET.value, _BUDGET.value - _MARGIN_S))
    else:  # --tests= : the benchmark alone (a later call of a device session)
        tests = dict(exit_code=5, counts={}, failures=[], skips={})
    steps = dict(tests=time.monotonic() - start)
    print(f"[device_check] tests: {tests['counts']} in {steps['tests']:.0f} s", flush=True)
    for failure in tests["failures"]:
        print(f"  FAILED {failure}", flush=True)
    left = _BUDGET.value - (time.monotonic() - start) - _MARGIN_S
    print(f"[device_check] benchmark, {left:.0f} s of budget", flush=True)
    bench_code = run_benchmark(out, left)
    steps["benchmark"] = time.monotonic() - start - steps["tests"]
    steps["total"] = time.monotonic() - start
    text = summary(out, tests, bench_code, steps)
    (out / "summary.md").write_text(text)
    print(text, flush=True)
    written = ", ".join(sorted(p.name for p in out.iterdir() if p.is_file()))
    print(f"[device_check] wrote {out}: {written}", flush=True)
    failed = tests["exit_code"] not in (0, 5) or tests["failures"] or bench_code != 0
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    app.run(main)
