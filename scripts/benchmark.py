r"""Benchmarks gated_attention against AlphaFold 2's own modules (alphafold-colabfold): the op
suite (with a same-FLOP matmul), the family suite (AF2's attention modules and EvoformerIteration)
and the GPU suite. Needs the `bench` extra (pip install -e '.[bench]').

  python scripts/benchmark.py                                     # configs/benchmark.py (~40 min)
  python scripts/benchmark.py --config=configs/benchmark.py:smoke # ~1 min: the harness runs
  python scripts/benchmark.py --config=configs/benchmark.py:quick --config.rounds=3
  python scripts/benchmark.py --config=configs/benchmark.py:device # GPU/TPU: device_benchmark.py
  python scripts/benchmark.py --config=configs/benchmark.py:family # AF2's modules and Evoformer
  python scripts/benchmark.py --config=configs/benchmark.py:smoke --config.output_dir=/tmp/smoke

Writes results.json (raw numbers), results.md (times in ms to three significant figures) and (with
matplotlib) the suite's pictures (gated_attention_tools/plots.py) to config.output_dir, a fresh
temporary folder where that is "" (the *_smoke presets), prints progress and the Markdown table,
and last the paths it wrote. A *_smoke preset checks that the suite runs, and says so.
"""

import os
import pathlib
import sys
import tempfile
import time

from absl import app, logging
from ml_collections import config_flags

# The tooling (gated_attention_tools) runs from this checkout, not the wheel: its root on the path.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    os.path.join(os.path.dirname(__file__), "..", "configs", "benchmark.py"),
    "Benchmark config (configs/benchmark.py[:preset]); override keys with --config.<key>=<value>.",
    lock_config=True,
)


SMOKE = (
    "smoke run: this checks that the benchmark runs end to end (fresh processes, timing, the "
    "baseline check, the tables and pictures), not how fast anything is: its shapes are tiny and "
    "it times one round, so its goals (time ratios of at most 100) and its baseline check (the "
    "baseline within 11x of its time alone) are loose on purpose and are met whenever the harness "
    "works."
)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from gated_attention_tools import environment

    environment.cpu_unless_accelerator()  # no GPU/TPU plugin tracebacks on a CPU machine
    from gated_attention_tools import suites

    cfg = _CONFIG.value
    if cfg.output_dir:
        out_dir = pathlib.Path(cfg.output_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
    else:  # the smoke presets: a fresh temporary folder
        out_dir = pathlib.Path(tempfile.mkdtemp(prefix=f"gated_attention_{cfg.suite}_"))
    if cfg.smoke:
        print(SMOKE, flush=True)
    start = time.time()
    try:
        _, table = suites.run(cfg, out_dir, log=lambda s: print(s, flush=True))
    except ImportError as e:
        if "matplotlib" not in str(e):
            raise
        logging.warning("matplotlib is not installed (pip install -e .[bench]); no plot written")
        table = (out_dir / "results.md").read_text()
    print(table)
    if cfg.smoke:
        print(SMOKE.split(":")[0] + ": the harness ran end to end.")
    written = sorted(p for p in out_dir.iterdir() if p.is_file() and p.stat().st_mtime >= start - 1)
    print(f"wrote {len(written)} files to {out_dir.resolve()}:")
    for path in written:
        print(f"  {path.resolve()}")


if __name__ == "__main__":
    app.run(main)
