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

import json
import os
import pathlib

from absl import app, logging
from ml_collections import config_flags

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
    from gated_attention_tools import (
        benchmark,
        context_memory,
        device_benchmark,
        device_memory,
        family_benchmark,
        mesh_memory,
        options_benchmark,
    )

    cfg = _CONFIG.value
    out_dir = pathlib.Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log = lambda s: print(s, flush=True)
    if cfg.suite == "device":
        results = device_benchmark.run(cfg, log=log)
        table = device_benchmark.markdown(results)
    elif cfg.suite == "device_memory":
        results = device_memory.run(cfg, log=log)
        table = device_memory.markdown(results)
    elif cfg.suite == "mesh_memory":
        results = mesh_memory.run(cfg, log=log)
        table = mesh_memory.markdown(results)
    elif cfg.suite == "context_memory":
        results = context_memory.run(cfg, log=log)
        table = context_memory.markdown(results)
    elif cfg.suite == "options":
        results = options_benchmark.run(cfg, log=log)
        table = options_benchmark.markdown(results)
    elif cfg.suite == "family":
        results = family_benchmark.run(cfg, log=log)
        table = family_benchmark.markdown(results)
    else:
        results = benchmark.run(cfg, log=log)
        table = benchmark.markdown(
            results["cells"], results["memory"], cfg.goals, results["allocator"]
        )
    (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    (out_dir / "results.md").write_text(table)
    print(table)
    try:
        _plot(cfg, results, out_dir)
    except ImportError:
        logging.warning("matplotlib is not installed (pip install -e .[bench]); no plot written")


def _plot(cfg, results, out_dir):
    """The suite's pictures (gated_attention_tools/plots.py), where it has data for them."""
    from gated_attention_tools import plots

    if cfg.suite == "family":
        if results["memory"]:
            plots.training_memory(results["memory"], str(out_dir / "training_memory.png"))
        if any(r["variant"] == "ours" and r["dtype"] == "float32" for r in results["cells"]):
            plots.family_ratios(results["cells"], results["goals"], str(out_dir / "ratios.png"))
    elif (
        cfg.suite not in ("device", "device_memory", "mesh_memory", "context_memory", "options")
        and cfg.sweep_lengths
    ):
        plots.op_sweep(results["cells"], str(out_dir / "results.png"))


if __name__ == "__main__":
    app.run(main)
