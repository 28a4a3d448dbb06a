r"""Benchmarks gated_attention.Attention against AlphaFold 2's formulation and a same-FLOP matmul.

  python scripts/benchmark.py                                     # configs/benchmark.py
  python scripts/benchmark.py --config=configs/benchmark.py:quick --config.rounds=3

Writes results.json, results.md and (with matplotlib, the 'bench' extra) results.png to
config.output_dir, and prints progress and the Markdown table.
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
    from gated_attention_tools import benchmark

    cfg = _CONFIG.value
    out_dir = pathlib.Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shapes = [benchmark.Shape(*s) for s in cfg.shapes]
    shapes += [
        benchmark.Shape(f"sweep 1x{n} c256 h8", 1, n, 256, 8, False, "key")
        for n in cfg.sweep_lengths
    ]
    benchmark.check_goals(cfg.goals, {s.name for s in shapes}, cfg.modes, cfg.implementations)
    cells = [(s, d, m) for s in shapes for d in cfg.dtypes for m in cfg.modes]
    # Family cells: float32 forward (their LayerNorm parameters are float32 in every mode).
    cells += [(benchmark.Shape(*s), "float32", "forward") for s in cfg.triangle_shapes]
    rows = []
    for i, (shape, dtype, mode) in enumerate(cells):
        print(f"[{i + 1}/{len(cells)}] {shape.name} {dtype} {mode}", flush=True)
        rows += benchmark.run_cell(
            shape,
            dtype,
            mode,
            list(cfg.implementations),
            cfg.rounds,
            cfg.steps,
            log=lambda s: print(s, flush=True),
        )
    memory_rows = []
    if cfg.memory_cases:
        for case in benchmark.memory_goal_cases():
            for impl in ("auto", "chunked"):
                print(f"memory: {case.name} {impl}", flush=True)
                memory_rows.append(benchmark.memory_case(case, impl))
    goals = benchmark.goal_rows(rows, cfg.goals)
    (out_dir / "results.json").write_text(
        json.dumps(dict(goals=goals, cells=rows, memory=memory_rows), indent=2)
    )
    table = benchmark.markdown(rows, memory_rows, cfg.goals)
    (out_dir / "results.md").write_text(table)
    print(table)
    if cfg.sweep_lengths:
        try:
            benchmark.plot(rows, "sweep", str(out_dir / "results.png"))
        except ImportError:
            logging.warning(
                "matplotlib is not installed (pip install -e .[bench]); no plot written"
            )


if __name__ == "__main__":
    app.run(main)
