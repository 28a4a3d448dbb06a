"""Device memory per target: AF2's attention family and EvoformerIteration compiled (never run) for a
GPU and a TPU with XLA's real compilers on this CPU machine (targets.py), ours against AF2's.

Each cell compiles one program in a child process for one target: a module's inference (its
update) or training step (the gradients of parameters and activations, the update's cotangent an
argument), at one crop, dtype and variant: AF2's module as installed, ours with the target's 'auto'
choice or one named implementation, and for the EvoformerIteration the block with attention
removed (the floor). memory_analysis gives the program's device memory; a cell fits when
arguments + outputs + temporaries fit the device. Crops grow until a program no longer fits, so the
tables say the longest crop each variant trains or infers on one device. Time is not measured:
no device runs anything.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from typing import Any

from gated_attention_tools import family_benchmark, targets

WHATS = (*family_benchmark.MODULES, "evoformer")
PAIR_CHANNELS = 128  # model_1's c_z


@dataclasses.dataclass(frozen=True)
class Cell:
    """One compile: `variant` is 'af2', 'floor', 'ours' ('auto') or 'ours:<implementation>'."""

    target: str
    what: str
    variant: str
    n_res: int
    n_seq: int
    dtype: str
    mode: str

    @property
    def implementation(self) -> str | None:
        return self.variant.split(":", 1)[1] if ":" in self.variant else None

    @property
    def family_variant(self) -> str:
        return self.variant.split(":", 1)[0]


def compile_cell(**fields) -> dict[str, Any]:
    """The child: compiles one cell for its target, returns its memory and our choices there."""
    import jax.numpy as jnp

    from gated_attention.attention import api as attention

    cell = Cell(**fields)
    fn, specs = family_benchmark.memory_problem(
        cell.what,
        cell.family_variant,
        cell.n_seq,
        cell.n_res,
        cell.dtype,
        cell.mode,
        implementation=cell.implementation,
    )
    start = time.perf_counter()
    with attention.record_implementation_choices() as choices:
        compiled = targets.compile(fn, *specs, target=cell.target)
    kind = targets.target(cell.target).kind
    # Calls traced in another platform's branch (the host's, staged beside it) are not this one's.
    chosen = sorted({c["by_platform"][kind]["chosen"] for c in choices if kind in c["by_platform"]})
    pair = cell.n_res**2 * PAIR_CHANNELS * jnp.dtype(cell.dtype).itemsize
    return dict(
        memory=targets.memory(compiled),
        pair_bytes=pair,
        chosen=chosen,
        compile_s=round(time.perf_counter() - start, 1),
    )


def _variants(cfg, what: str, target: str) -> list[str]:
    extra = [f"ours:{name}" for name in cfg.implementations.get(targets.target(target).kind, ())]
    floor = ["floor"] if what == "evoformer" else []
    return ["af2", "ours", *extra, *floor]


def run(cfg, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every (target, module, dtype, mode, variant) at growing crops, until one does not fit."""
    import jax

    rows = []
    for target, what, dtype, mode in itertools.product(
        cfg.targets, cfg.whats, cfg.dtypes, cfg.modes
    ):
        device_bytes = targets.target(target).memory_bytes
        for variant in _variants(cfg, what, target):
            for n_res in cfg.crops:
                n_seq = cfg.extra_msa_rows if what == "msa_column_global" else cfg.msa_rows
                cell = Cell(target, what, variant, n_res, n_seq, dtype, mode)
                row = dataclasses.asdict(cell)
                try:
                    row |= targets.in_child(
                        "gated_attention_tools.device_memory:compile_cell", row, log
                    )
                except RuntimeError as e:
                    row["error"] = str(e).strip().splitlines()[-1][:300]
                    log(f"{target} {what} {variant} {n_res} {dtype} {mode}: {row['error']}")
                    rows.append(row)
                    break
                row["fits"] = row["memory"]["peak"] <= device_bytes
                log(
                    f"{target} {what} {variant} N_res {n_res} {dtype} {mode}: peak "
                    f"{row['memory']['peak'] / 2**30:.2f} GiB, temp "
                    f"{row['memory']['temp'] / 2**30:.2f} GiB ({row['chosen']}, "
                    f"{row['compile_s']} s)"
                )
                rows.append(row)
                if not row["fits"]:
                    break
    return dict(
        suite="device_memory",
        versions=dict(jax=jax.__version__, jaxlib=jax.lib.__version__),
        targets={t: dataclasses.asdict(targets.target(t)) for t in cfg.targets},
        msa_rows=cfg.msa_rows,
        extra_msa_rows=cfg.extra_msa_rows,
        rows=rows,
    )


def longest(rows, **where) -> int | None:
    """The longest crop that fits among rows matching `where` (None: none fits)."""
    fits = [r["n_res"] for r in rows if r.get("fits") and all(r[k] == v for k, v in where.items())]
    return max(fits) if fits else None


def markdown(results: dict[str, Any]) -> str:
    rows = results["rows"]
    lines = [
        "# Device memory per target (deviceless compiles; no time measured)",
        "",
        f"jax {results['versions']['jax']}; MSA {results['msa_rows']} rows, extra MSA "
        f"{results['extra_msa_rows']} rows; peak = arguments + outputs + temporaries.",
        "",
        "## Longest crop that fits one device (of the crops compiled)",
        "",
        "| target | module | dtype | mode | " + " | ".join(_variant_names(rows)) + " |",
        "| --- | --- | --- | --- | " + " | ".join("---:" for _ in _variant_names(rows)) + " |",
    ]
    keys = dict.fromkeys((r["target"], r["what"], r["dtype"], r["mode"]) for r in rows)
    for target, what, dtype, mode in keys:
        cells = []
        for variant in _variant_names(rows):
            where = dict(target=target, what=what, dtype=dtype, mode=mode, variant=variant)
            present = any(all(r[k] == v for k, v in where.items()) for r in rows)
            best = longest(rows, **where)
            tried = [r for r in rows if all(r[k] == v for k, v in where.items())]
            more = bool(tried) and tried[-1].get("fits", False)  # never ran out of memory
            text = "none" if best is None else f">= {best}" if more else str(best)
            cells.append(text if present else "")
        lines.append(f"| {target} | {what} | {dtype} | {mode} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Every compile (GiB; temp/pair: temporaries over the pair's own size)",
        "",
        "| target | module | variant | N_res | dtype | mode | chosen | peak | temp | temp/pair |",
        "| --- | --- | --- | ---: | --- | --- | --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['target']} | {r['what']} | {r['variant']} | {r['n_res']} | {r['dtype']} "
                f"| {r['mode']} | | error: {r['error'][:80]} | | |"
            )
            continue
        m = r["memory"]
        lines.append(
            f"| {r['target']} | {r['what']} | {r['variant']} | {r['n_res']} | {r['dtype']} | "
            f"{r['mode']} | {','.join(r['chosen'])} | {m['peak'] / 2**30:.2f} | "
            f"{m['temp'] / 2**30:.2f} | {m['temp'] / r['pair_bytes']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def _variant_names(rows) -> list[str]:
    return list(dict.fromkeys(r["variant"] for r in rows))
