"""The design suite: ColabDesign's design step (a loss and its gradient with respect to the
sequence through its whole AF2, as `mk_afdesign_model(...).run()` takes it: design_model.py) with
ColabDesign's own attention ('colabdesign', the baseline: what its users run) and with ours
('ours': gated_attention.colabdesign.use_gated_attention), ColabDesign's defaults otherwise
(bfloat16, remat, dropout), random parameters of AF2's full depth.

Two parts, each optional:
  memory: the step compiled without a device for GPU targets (targets.py): XLA's peak (arguments
    + outputs + temporaries) per (target, case, length, variant), and the longest length that
    fits each target, searched in `length_step`s. Each compile in a child process.
  time: the step on this machine's CPU, both variants compiled in one child process and timed
    interleaved (`rounds`, the median), every child under one malloc policy, the baseline timed
    alone in a fresh process too (its harness time must match: measure.check_baseline), and each
    variant's resident peak (VmHWM) in a fresh process of its own (measure.resident_memory).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

VARIANTS = ("colabdesign", "ours")
BASELINE = "colabdesign"


def _swap(variant: str):
    import contextlib

    import gated_attention as ga

    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    return ga.colabdesign.use_gated_attention() if variant == "ours" else contextlib.nullcontext()


def problem(case: str, length: int, variant: str, dtype: str = "bfloat16", blocks=None):
    """(fn, args): ColabDesign's jitted design step (its grad_fn) with the variant's attention
    traced in, and the abstract arguments ColabDesign passes it (random parameters' shapes)."""
    import gated_attention as ga
    from gated_attention_tools import design_model

    model = design_model.build(
        case, length, bfloat16=dtype == "bfloat16", blocks=blocks, params=False
    )
    args = ga.colabdesign.step_arguments(model, ga.colabdesign.param_shapes(model))
    grad_fn, swap = model._model["grad_fn"], _swap(variant)

    def step(*args):
        with swap:
            return grad_fn(*args)

    return step, args


def compile_cell(
    case: str, length: int, variant: str, target: str, blocks: int | None = None
) -> dict[str, Any]:
    """The child: one cell compiled for its target; its memory and the compile's seconds."""
    from gated_attention_tools import measure, targets

    start = time.perf_counter()
    fn, args = problem(case, length, variant, blocks=blocks)
    compiled = targets.compile(fn, *args, target=target)
    return dict(
        memory=measure.compiled_memory(compiled), compile_s=round(time.perf_counter() - start)
    )


def memory_cell(case, length, variant, target, log=print, blocks=None) -> dict[str, Any]:
    """compile_cell in a child process: the row, with whether its peak fits the target."""
    from gated_attention_tools import targets

    row = dict(case=case, length=length, variant=variant, target=target, blocks=blocks)
    try:
        got = targets.in_child("gated_attention_tools.design_benchmark:compile_cell", row, log)
    except RuntimeError as e:
        return row | dict(error=str(e).strip().splitlines()[-1][:300], fits=False)
    peak = got["memory"]["peak"]
    return row | got | dict(peak_gib=peak / 2**30, fits=peak <= targets.target(target).memory_bytes)


def longest(case, variant, target, start, step, log=print, blocks=None) -> list[dict]:
    """Rows from `start` residues up (while they fit) or down (while they don't) in `step`s."""
    from gated_attention_tools import targets

    at = lambda n: memory_cell(case, n, variant, target, log, blocks)
    return targets.search_longest(at, start, step)


def time_cell(case, length, dtype, variants, rounds, blocks=None) -> list[dict]:
    """The child: each variant's design step compiled (its first call), then the variants called
    in turn `rounds` times; the median seconds per step of each, and its loss."""
    from gated_attention_tools import design_model

    model = design_model.build(case, length, bfloat16=dtype == "bfloat16", blocks=blocks)
    first, times, losses = {}, {v: [] for v in variants}, {}
    for variant in variants:
        start = time.perf_counter()
        with _swap(variant):
            losses[variant] = design_model.design_step(model)[0]
        first[variant] = time.perf_counter() - start
    for _ in range(rounds):
        for variant in variants:
            with _swap(variant):
                start = time.perf_counter()
                design_model.design_step(model)
                times[variant].append(time.perf_counter() - start)
    return [
        dict(case=case, length=length, dtype=dtype, mode="design step", variant=v,
             time_ms=1e3 * statistics.median(times[v]), first_call_s=first[v], loss=losses[v])
        for v in variants
    ]  # fmt: skip


def resident_problem(case: str, length: int, dtype: str, variant: str, blocks=None):
    """measure.resident_memory's builder: (fn, specs) of one design step on the CPU, its
    arguments flattened (the probe makes each leaf, ones)."""
    import jax

    step, args = problem(case, length, variant, dtype, blocks)
    leaves, treedef = jax.tree_util.tree_flatten(args)
    return (lambda *leaves: step(*jax.tree_util.tree_unflatten(treedef, leaves))), tuple(leaves)


def _time_rows(cfg, log) -> list[dict]:
    from gated_attention_tools import child, measure

    rows = []
    for case, length in cfg.time_cells:
        for dtype in cfg.dtypes:
            kwargs = dict(
                case=case, length=length, dtype=dtype, rounds=cfg.rounds, blocks=cfg.blocks
            )
            target = "gated_attention_tools.design_benchmark:time_cell"
            cell = child.call(target, kwargs | dict(variants=list(VARIANTS)), log, cfg.allocator)
            alone = child.call(target, kwargs | dict(variants=[BASELINE]), log, cfg.allocator)
            cell = measure.check_baseline(
                cell, alone[0]["time_ms"], cfg.baseline_tolerance, BASELINE
            )
            for row in cell:
                args = dict(
                    case=case, length=length, dtype=dtype, variant=row["variant"], blocks=cfg.blocks
                )
                resident = measure.resident_memory(
                    "gated_attention_tools.design_benchmark:resident_problem", args
                )
                row["resident_mib"] = resident["resident_mib"]
            base = next(r["time_ms"] for r in cell if r["variant"] == BASELINE)
            rows += [r | dict(over_baseline=r["time_ms"] / base) for r in cell]
            log(f"time {case} {length} {dtype}: " + ", ".join(
                f"{r['variant']} {r['time_ms']:.0f} ms" for r in cell))  # fmt: skip
    return rows


def _memory_rows(cfg, log) -> tuple[list[dict], list[dict]]:
    """cfg.memory_cells: (target, case, variant, residues) compiled; cfg.longest_cells: (target,
    case, variant, start) searched in cfg.length_step's."""
    quiet = lambda line: None
    cells, searches = [], []
    for target, case, variant, length in cfg.memory_cells:
        cells.append(memory_cell(case, length, variant, target, quiet, cfg.blocks))
        log(f"memory {target} {case} {variant} {length}: {_peak(cells[-1])}")
    for target, case, variant, start in cfg.longest_cells:
        searches += longest(case, variant, target, start, cfg.length_step, quiet, cfg.blocks)
        log(f"longest {target} {case} {variant}: {_longest(searches, case, variant, target)}")
    return cells, searches


def _peak(row) -> str:
    return f"{row['peak_gib']:.2f} GiB" if "peak_gib" in row else row["error"]


def _longest(rows, case, variant, target) -> int | None:
    fits = [
        r["length"]
        for r in rows
        if (r["case"], r["variant"], r["target"]) == (case, variant, target) and r["fits"]
    ]  # noqa: E501
    return max(fits, default=None)


def run(cfg, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The suite (scripts/benchmark.py --config=configs/benchmark.py:design)."""
    cells, searches = _memory_rows(cfg, log)
    times = _time_rows(cfg, log) if cfg.time_cells else []
    return dict(memory=cells, longest=searches, time=times, allocator=cfg.allocator)


def markdown(results: dict[str, Any]) -> str:
    """The suite's tables: peaks per target and length, the longest that fits, CPU times."""
    from gated_attention_tools import measure

    lines = []
    if results["memory"]:
        lines += ["Design step, bfloat16, compiled without a device: XLA's peak, GiB "
                  "(ours / ColabDesign's own).", "",
                  "| target | case | residues | ColabDesign's own | ours | ours / own |",
                  "| --- | --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
        by = {(r["target"], r["case"], r["length"], r["variant"]): r for r in results["memory"]}
        for key in dict.fromkeys(k[:3] for k in by):
            base, ours = by.get((*key, BASELINE), {}), by.get((*key, "ours"), {})
            both = "peak_gib" in base and "peak_gib" in ours
            ratio = f"{ours['peak_gib'] / base['peak_gib']:.2f}" if both else ""
            cells = [_peak(r) if r else "" for r in (base, ours)]
            lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {cells[0]} | {cells[1]} | {ratio} |")
    if results["longest"]:
        lines += ["", "| target | case | longest that fits: ColabDesign's own | ours | ours / own |",
                  "| --- | --- | ---: | ---: | ---: |"]  # fmt: skip
        keys = sorted({(r["target"], r["case"]) for r in results["longest"]})
        for target, case in keys:
            a = _longest(results["longest"], case, BASELINE, target)
            b = _longest(results["longest"], case, "ours", target)
            ratio = f"{b / a:.2f}" if a and b else ""
            lines.append(f"| {target} | {case} | {a} | {b} | {ratio} |")
    if results["time"]:
        lines += ["", "Design step on this machine's CPU, interleaved in one process: median ms.", "",
                  "| case | residues | dtype | variant | ms | over ColabDesign's | resident MiB | baseline alone (ms, harness/alone) |",
                  "| --- | ---: | --- | --- | ---: | ---: | ---: | --- |"]  # fmt: skip
        for r in results["time"]:
            lines.append(f"| {r['case']} | {r['length']} | {r['dtype']} | {r['variant']} | "
                         f"{measure.figure(r['time_ms'])} | {r['over_baseline']:.2f} | "
                         f"{r['resident_mib']:.0f} | {measure.alone_cell(r, BASELINE)} |")  # fmt: skip
        allocator = dict(
            policy=results["allocator"], env=measure.allocator_env(results["allocator"])
        )
        lines += ["", measure.allocator_line(allocator, results["time"], "case")]
    return "\n".join(lines) + "\n"
