r"""Benchmarks gated_attention against AlphaFold 2's own modules (alphafold-colabfold): the op
suite (with a same-FLOP matmul), the family suite (AF2's attention modules and EvoformerIteration)
and the GPU suite.

  python scripts/benchmark.py                                     # configs/benchmark.py
  python scripts/benchmark.py --config=configs/benchmark.py:quick --config.rounds=3
  python scripts/benchmark.py --config=configs/benchmark.py:device # GPU/TPU: device_benchmark.py
  python scripts/benchmark.py --config=configs/benchmark.py:family # AF2's modules and Evoformer

Writes results.json, results.md and (with matplotlib, the 'bench' extra) the suite's pictures
(gated_attention_tools/plots.py) to config.output_dir, and prints progress and the Markdown table.
"""

import os
import pathlib
import sys

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


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from gated_attention_tools import environment

    environment.cpu_unless_accelerator()  # no GPU/TPU plugin tracebacks on a CPU machine
    from gated_attention_tools import suites

    cfg = _CONFIG.value
    out_dir = pathlib.Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        _, table = suites.run(cfg, out_dir, log=lambda s: print(s, flush=True))
    except ImportError as e:
        if "matplotlib" not in str(e):
            raise
        logging.warning("matplotlib is not installed (pip install -e .[bench]); no plot written")
        table = (out_dir / "results.md").read_text()
    print(table)


if __name__ == "__main__":
    app.run(main)
