"""The benchmark suites scripts/benchmark.py runs, one registry: a config's `suite` names one.

Each suite is a module of gated_attention_tools with run(cfg, log) -> results (JSON-ready) and a
markdown table of them; `plots` draws its pictures where it has data for them.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class Suite:
    module: str  # of gated_attention_tools: run(cfg, log) and markdown(...)
    table: Callable[[Any, dict, Any], str]  # (module, results, cfg) -> markdown
    plots: Callable[[dict, Any, Path], None] | None = None  # (results, cfg, out_dir)
    # Further files beside results.json (results, cfg, out_dir): the sweep's tuning.json.
    files: Callable[[dict, Any, Path], None] | None = None


def _family_plots(results, cfg, out_dir):
    from gated_attention_tools import plots

    if results["memory"]:
        plots.training_memory(results["memory"], str(out_dir / "training_memory.png"))
    if any(r.get("variant") == "ours" and r["dtype"] == "float32" for r in results["cells"]):
        plots.family_ratios(
            [r for r in results["cells"] if "unavailable" not in r],
            results["goals"],
            str(out_dir / "ratios.png"),
        )


def _modules_plots(results, cfg, out_dir):
    from gated_attention_tools import plots

    if cfg.sweep_lengths:
        plots.op_sweep(results["cells"], str(out_dir / "results.png"))


_markdown = lambda module, results, cfg: module.markdown(results)
SUITES = {
    "modules": Suite(
        "benchmark",
        lambda m, r, cfg: m.markdown(r["cells"], r["memory"], cfg.goals, r["allocator"]),
        _modules_plots,
    ),
    "family": Suite("family_benchmark", _markdown, _family_plots),
    "device": Suite("device_benchmark", _markdown),
    "compile_memory": Suite("compile_memory", _markdown),
    "options": Suite("options_benchmark", _markdown),
    "design": Suite("design_benchmark", _markdown),
    "sweep": Suite("sweep", _markdown, files=lambda r, cfg, out: _sweep_table(r, cfg, out)),
}


def _sweep_table(results, cfg, out_dir):
    from gated_attention_tools import sweep

    sweep.write_table(results, cfg, out_dir)


def run(cfg, out_dir: Path, log: Callable[[str], None] = print) -> tuple[dict, str]:
    """Runs cfg.suite, writes results.json, results.md, its further files and its pictures into
    out_dir, and returns (results, table). ImportError from the pictures (no matplotlib)
    propagates after the results are written."""
    import json

    if cfg.suite not in SUITES:
        raise ValueError(f"config.suite must be one of {sorted(SUITES)}, got {cfg.suite!r}")
    suite = SUITES[cfg.suite]
    module = importlib.import_module(f"gated_attention_tools.{suite.module}")
    results = module.run(cfg, log=log)
    table = suite.table(module, results, cfg)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    (out_dir / "results.md").write_text(table)
    if suite.files is not None:
        suite.files(results, cfg, out_dir)
    if suite.plots is not None:
        suite.plots(results, cfg, out_dir)
    return results, table
