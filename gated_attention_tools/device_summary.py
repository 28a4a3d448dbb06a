"""Where we stand on a device, per level, from a device run's results.json: the table README.md and
docs/gpu_tpu.md quote (tests/test_docs.py checks they quote it as this module writes it).

    python -m gated_attention_tools.device_summary benchmark_results/device/h100/results.json
    python -m gated_attention_tools.device_summary --update README.md docs/gpu_tpu.md  # after a run
    python -m gated_attention_tools.device_summary --plot benchmark_results/device/h100/results.json \
        benchmark_results/device/h100/times.png

Each figure is ours ('auto' for the attention alone, the Attention module at the module level)
over the other's time, bfloat16, as the run's results.md gives a ratio: the median of the per-round
ratios (the rounds are interleaved); a range spans AF2's shapes (the MSA row and the triangle
cells). A comparison or level the run did not time says "not measured".
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from gated_attention_tools import device_benchmark

# Peers at the op level, as the device benchmark names them, with what they ran.
OP_PEERS = (
    (
        "af2_colabfold",
        "ColabFold's kernel (`tri_flash`, colabfold-kernels 0.9.0, `use_pallas=True`)",
    ),
    (
        "af2_colabfold_packed",
        "ColabFold's packed kernel, as its AF2 modules run it (Mosaic GPU on Hopper)",
    ),
    ("tokamax_mosaic", "tokamax's Mosaic GPU kernel (tokamax 0.0.17)"),
    ("tokamax_triton", "tokamax's Triton kernel (tokamax 0.0.17)"),
    ("jax_nn_cudnn", "jax.nn's cuDNN attention"),
    ("jax_nn_xla", "jax.nn's XLA attention"),
)
# The family suite's variants (family_benchmark.py) at the module level: ours inside AF2 against
# AF2 as ColabFold runs it on a GPU (use_pallas=True: its fused and packed kernels).
FAMILY = "family*/results.json"  # a run folder's module cells, one folder per call
MODULES = dict(
    msa_row="MSA row", msa_column="MSA column", msa_column_global="MSA column global",
    triangle_start="triangle", triangle_end="triangle (ending node)", evoformer="Evoformer",
)  # fmt: skip
# An op cell further than this from the float32 reference (rel. diff) is wrong, not compared:
# the sweep's bfloat16 tolerance (configs/benchmark.py).
WRONG = 0.05
MODES = ("forward", "forward_backward")
LONG = "long"  # the one-sequence cell, apart from AF2's shapes


def _times(cells: list[dict], level: str) -> dict:
    """{(shape, mode): {variant: [ms per round]}} of the bfloat16 cells that were timed."""
    found: dict = {}
    for c in cells:
        wrong = level == "op" and (c.get("rel_diff_vs_float32") or 0.0) > WRONG
        if c["level"] == level and c["dtype"] == "bfloat16" and c.get("time_ms") and not wrong:
            rounds = c.get("rounds_ms") or [c["time_ms"]]
            found.setdefault((c["shape"], c["mode"]), {})[c["variant"]] = rounds
    return found


def _round_ratio(ours: list[float], theirs: list[float]) -> float:
    """The median over interleaved rounds of ours / theirs in the same round."""
    return statistics.median(o / p for o, p in zip(ours, theirs, strict=True))


def _span(ratios: list[float]) -> str:
    if not ratios:
        return "not measured"
    low, high = min(ratios), max(ratios)
    return f"{low:.2f}x" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}-{high:.2f}x"


def _ratios(times: dict, ours: str, peer: str, mode: str, long: bool) -> list[float]:
    """Per shape, the median over rounds of ours / the peer's time in the same round."""
    return [
        _round_ratio(t[ours], t[peer])
        for (shape, m), t in times.items()
        if m == mode and shape.startswith(LONG) == long and ours in t and peer in t
    ]


def load(run_dir: Path) -> dict:
    """A run folder's results.json, with its family suite's cells (FAMILY) under "family"."""
    results = json.loads((run_dir / "results.json").read_text())
    family = sorted(run_dir.glob(FAMILY))
    results["family"] = [c for f in family for c in json.loads(f.read_text())["cells"]]
    return results


def _family_ratios(cells: list[dict], mode: str) -> list[float]:
    """Per family cell timed in `mode`, the median over rounds of ours / ColabFold's AF2's."""
    by_cell: dict = {}
    for c in cells:
        if c["mode"] == mode and c["dtype"] == "bfloat16" and c.get("rounds_ms"):
            by_cell.setdefault(c["cell"], {})[c["variant"]] = c["rounds_ms"]
    return [
        _round_ratio(t["ours"], t["colabfold"])
        for t in by_cell.values()
        if "ours" in t and "colabfold" in t
    ]


def table(results: dict) -> str:
    """The markdown table: a caption line naming the device, then one row per level and peer
    (the family rows from load()'s "family" cells, "not measured" without them)."""
    env = results["environment"]
    op, module = _times(results["cells"], "op"), _times(results["cells"], "module")
    lines = [
        f"Measured on one {env['device_kind']} (jax {env['jax']}, {env['date_utc'][:10]}), "
        "bfloat16: our time / theirs, the median of interleaved rounds (below 1: ours is faster).",
        "",
        "| ours / theirs | inference, AF2's shapes | training step, AF2's shapes "
        "| inference, one sequence of 16,384 | training step, one sequence of 16,384 |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for peer, name in OP_PEERS:
        spans = [_span(_ratios(op, "auto", peer, m, long)) for long in (False, True) for m in MODES]
        lines.append(f"| attention alone, against {name} | " + " | ".join(spans) + " |")
    spans = [
        _span(_ratios(module, "ours", "af2", m, long)) for long in (False, True) for m in MODES
    ]
    lines.append(
        "| AF2's Attention module, against AF2's own as installed (XLA attention) | "
        + " | ".join(spans)
        + " |"
    )
    family = results.get("family", [])
    spans = [_span(_family_ratios(family, m)) for m in ("inference", "training")]
    what = sorted({MODULES.get(c["what"], c["what"]) for c in family}) or ["attention"]
    lines.append(
        f"| AF2's {', '.join(what)} modules, ours inside AF2 against AF2 as ColabFold runs "
        "it (`use_pallas=True`) | " + " | ".join(spans) + " | not measured | not measured |"
    )
    shares = [_floor_share(results, m, long) for long in (False, True) for m in MODES]
    lines.append(
        f"| attention alone: % of the {_short(env['device_kind'])}'s peak rate it reaches "
        "(limited by exp: exponentials, hbm: memory bandwidth) | " + " | ".join(shares) + " |"
    )
    return "\n".join(lines)


def _short(device_kind: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'H100'."""
    words = [w for w in device_kind.split() if w.upper() != "NVIDIA"]
    return words[0] if words else device_kind


def _floor_share(results: dict, mode: str, long: bool) -> str:
    """floor / time of ours ('auto') over the bfloat16 op cells, as a range of percentages, and
    what bounds the floor there (floor.py)."""
    kind = results["environment"]["device_kind"]
    found = []
    for row in results["cells"]:
        if (row["level"], row["dtype"], row["mode"], row["variant"]) != (
            "op",
            "bfloat16",
            mode,
            "auto",
        ):
            continue
        low = device_benchmark.cell_floor(row, kind)
        if row.get("time_ms") and low and row["shape"].startswith(LONG) == long:
            found.append((100 * low["floor_ms"] / row["time_ms"], low["bound"]))
    if not found:
        return "not measured"
    low, high = f"{min(f for f, _ in found):.0f}", f"{max(f for f, _ in found):.0f}"
    bounds = "/".join(sorted({b for _, b in found}))
    return f"{low} % ({bounds})" if low == high else f"{low}-{high} % ({bounds})"


MARKER = "<!-- device-summary: {run} -->"  # a page's line before the table of that run


def update(page: Path, runs_dir: Path) -> bool:
    """Rewrites the table after each marker on the page from runs_dir/RUN/results.json; returns
    whether the page changed."""
    lines = page.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        out.append(lines[i])
        run = lines[i].removeprefix("<!-- device-summary: ").removesuffix(" -->")
        if lines[i] == MARKER.format(run=run):
            new = table(load(runs_dir / run)).splitlines()
            out += new
            i += 1
            while i < len(lines) and lines[i].strip():  # the old caption
                i += 1
            i += 1  # the blank line between caption and table
            while i < len(lines) and lines[i].startswith("|"):  # the old table
                i += 1
            continue
        i += 1
    text = "\n".join(out) + "\n"
    changed = text != page.read_text()
    page.write_text(text)
    return changed


def main(argv: list[str]) -> None:
    """RESULTS_JSON: print its table; --update PAGE...: rewrite the pages' marked tables;
    --plot RESULTS_JSON PNG: draw its bfloat16 op cells with the floor (plots.device_times)."""
    if len(argv) == 4 and argv[1] == "--plot":
        from gated_attention_tools import plots

        results = json.loads(Path(argv[2]).read_text())
        kind = results["environment"]["device_kind"]
        floor_of = lambda row: (device_benchmark.cell_floor(row, kind) or {}).get("floor_ms")
        plots.device_times(results, argv[3], floor_of)
        print(f"wrote {Path(argv[3]).resolve()}")
        return
    if len(argv) > 2 and argv[1] == "--update":
        runs = Path(__file__).resolve().parents[1] / "benchmark_results" / "device"
        for page in argv[2:]:
            print(page, "updated" if update(Path(page), runs) else "unchanged")
        return
    if len(argv) != 2:
        sys.exit(
            f"usage: python -m gated_attention_tools.device_summary RESULTS_JSON | --update PAGE..., got {argv[1:]}"
        )
    print(table(load(Path(argv[1]).parent)))


if __name__ == "__main__":
    main(sys.argv)
