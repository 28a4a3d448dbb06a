"""The benchmarks' pictures (matplotlib, the 'bench' extra), drawn from their results.json.

  * op_sweep: time against sequence length, one panel per mode, one colour per implementation (AF2
    always black), one line style per dtype, and below each its ratio to AF2.
  * training_memory: a training step's memory against the crop, ours and AF2's, log-log, with the
    memory of common devices drawn across.
  * family_ratios: each family module's time over AF2's, inference and training step, as bars with
    the rounds' range and the goal.
  * device_times: a device run's bfloat16 op cells, ours beside the peers, with the hardware floor
    (device_summary.py draws it: `--plot`).

`python -m gated_attention_tools.plots <results dir> [<family results dir>]` redraws them.
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any

AF2_COLOUR = "black"
COLOURS = {"auto": "tab:blue", "xla": "tab:orange", "chunked": "tab:green", "ours": "tab:blue"}
DTYPE_STYLES = {"float32": "-", "bfloat16": "--", "float16": ":"}
MODE_TITLES = {
    "forward": "forward (inference)",
    "forward_backward": "training step (forward + backward)",
    "inference": "inference",
    "training": "training step",
}
DEVICES_GB = (
    ("16 GB (TPU v5e, V100)", 16),
    ("40 GB (A100 40G)", 40),
    ("80 GB (H100, A100 80G)", 80),
)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colour(variant: str) -> str:
    return AF2_COLOUR if variant == "af2" else COLOURS.get(variant, "tab:purple")


def op_sweep(rows: list[dict[str, Any]], path: str, prefix: str = "sweep", title: str = "") -> None:
    """Time (top) and ratio to AF2 (bottom) against sequence length, a column per mode."""
    plt = _pyplot()
    sweep = [r for r in rows if r["shape"].startswith(prefix) and r["variant"] != "matmul"]
    modes = [m for m in MODE_TITLES if any(r["mode"] == m for r in sweep)]
    if not modes:
        raise ValueError(f"no rows whose shape starts with {prefix!r} to plot")
    fig, axes = plt.subplots(2, len(modes), figsize=(5.5 * len(modes), 7), squeeze=False)
    for col, mode in enumerate(modes):
        ax_t, ax_r = axes[0][col], axes[1][col]
        keys = sorted({(r["variant"], r["dtype"]) for r in sweep if r["mode"] == mode})
        for variant, dtype in keys:
            pts = sorted(
                (r["length"], r["time_ms"], r["ratio_to_af2"])
                for r in sweep
                if (r["mode"], r["variant"], r["dtype"]) == (mode, variant, dtype)
            )
            style = dict(
                color=_colour(variant), linestyle=DTYPE_STYLES.get(dtype, "-."), marker="o"
            )
            label = f"{'AF2' if variant == 'af2' else variant} {dtype}"
            ax_t.plot([p[0] for p in pts], [p[1] for p in pts], label=label, **style)
            if variant != "af2":
                ax_r.plot([p[0] for p in pts], [p[2] for p in pts], label=label, **style)
        ax_r.axhline(1.0, color=AF2_COLOUR, linewidth=1)
        ax_t.set_title(MODE_TITLES[mode])
        ax_t.set_ylabel("time (ms)")
        ax_t.set_yscale("log")
        ax_r.set_ylabel("time / AF2's (same round)")
        ax_r.set_ylim(bottom=0)
        for ax in (ax_t, ax_r):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("sequence length (1 sequence, c 256, 8 heads of 32)")
            ax.grid(True, which="both", alpha=0.3)
        ax_t.legend(fontsize=7)
    fig.suptitle(title or "Attention against AF2's Attention, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _memory_mib(m: dict[str, Any]) -> float | None:
    known = [x for x in (m.get("temp_mib"), m.get("resident_mib")) if x is not None]
    return max(known) if known else None


def training_memory(memory: list[dict[str, Any]], path: str, title: str = "") -> None:
    """A training step's memory (the larger of XLA temp and resident) against N_res, log-log, one
    panel per module, ours and AF2's, with device memories drawn across."""
    plt = _pyplot()
    modules = sorted({m["what"] for m in memory})
    if not modules:
        raise ValueError("no memory rows to plot")
    fig, axes = plt.subplots(1, len(modules), figsize=(6 * len(modules), 4.8), squeeze=False)
    for ax, what in zip(axes[0], modules, strict=True):
        for variant in ("ours", "af2"):
            pts = sorted(
                (m["n_res"], _memory_mib(m) / 1024)
                for m in memory
                if m["what"] == what and m["variant"] == variant and _memory_mib(m) is not None
            )
            if pts:
                label = "AF2 (alphafold-colabfold)" if variant == "af2" else "ours"
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    marker="o",
                    color=_colour(variant),
                    label=label,
                )
        for label, gb in DEVICES_GB:
            ax.axhline(gb * 1e9 / 2**30, color="tab:red", linewidth=0.8, linestyle=":")
            ax.text(
                0.01,
                gb * 1e9 / 2**30,
                label,
                transform=ax.get_yaxis_transform(),
                fontsize=7,
                color="tab:red",
                va="bottom",
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("N_res (crop)")
        ax.set_ylabel("GiB beyond inputs and outputs")
        ax.set_title(f"{what}: training step, float32")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(title or "Training-step memory against the crop (AF2's grows as N^3, ours as N^2)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def family_ratios(cells: list[dict[str, Any]], goals: list[dict[str, Any]], path: str) -> None:
    """Bars of ours / AF2 per module and mode (float32), the rounds' range as error bars, each
    bar's goal (family_benchmark.goal_rows' 'what', 'mode' and 'limit') as a short red line."""
    plt = _pyplot()
    ours = [c for c in cells if c["variant"] == "ours" and c["dtype"] == "float32"]
    names = list(dict.fromkeys(c["cell"] for c in ours))
    modes = [m for m in ("inference", "training") if any(c["mode"] == m for c in ours)]
    if not names:
        raise ValueError("no float32 'ours' cells to plot")
    limits = {(g["what"], g["mode"]): g["limit"] for g in goals if "limit" in g and "mode" in g}
    fig, ax = plt.subplots(figsize=(max(7, 1.5 * len(names)), 4.5))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        xs, ys, lo, hi = [], [], [], []
        for j, name in enumerate(names):
            row = next((c for c in ours if (c["cell"], c["mode"]) == (name, mode)), None)
            if row is None:
                continue
            x = j + (i - (len(modes) - 1) / 2) * width
            xs.append(x)
            ys.append(row["ratio_to_af2"])
            lo.append(row["ratio_to_af2"] - row["ratio_range"][0])
            hi.append(row["ratio_range"][1] - row["ratio_to_af2"])
            limit = limits.get((row["what"], mode))
            if limit is not None:
                ax.plot([x - width / 2, x + width / 2], [limit, limit], color="tab:red")
        bars = ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=MODE_TITLES[mode])
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.plot([], [], color="tab:red", label="goal")
    ax.axhline(1.0, color=AF2_COLOUR, linewidth=1, label="AF2")
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("time / AF2's (median of rounds)")
    ax.set_title("AF2's modules with our attention, float32, CPU")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


DEVICE_BARS = (  # (variant, label, colour): ours and the peers of the device summary
    ("auto", "ours ('auto')", "tab:blue"),
    ("af2_colabfold", "ColabFold's kernel", "black"),
    ("tokamax_mosaic", "tokamax Mosaic GPU", "tab:purple"),
    ("jax_nn_cudnn", "jax.nn cuDNN", "tab:green"),
    ("jax_nn_xla", "jax.nn XLA", "tab:orange"),
)


def device_times(results: dict[str, Any], path: str, floor_of=None) -> None:
    """The bfloat16 op cells of a device run: each variant's median time as a bar (log scale),
    one panel per mode, the cell's hardware floor (floor_of(row) -> ms or None) as a tick."""
    plt = _pyplot()
    cells = [c for c in results["cells"] if c["level"] == "op" and c["dtype"] == "bfloat16"]
    shapes = list(dict.fromkeys(c["shape"] for c in cells if c.get("time_ms")))  # timed ones
    modes = ("forward", "forward_backward")
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=False)
    width = 0.8 / len(DEVICE_BARS)
    for ax, mode in zip(axes, modes, strict=True):
        for j, (variant, label, colour) in enumerate(DEVICE_BARS):
            times = []
            for shape in shapes:
                row = next(
                    (
                        c
                        for c in cells
                        if (c["shape"], c["mode"], c["variant"]) == (shape, mode, variant)
                    ),
                    None,
                )
                times.append(row.get("time_ms") if row else None)
            xs = [i + (j - (len(DEVICE_BARS) - 1) / 2) * width for i in range(len(shapes))]
            ax.bar(
                [x for x, t in zip(xs, times, strict=True) if t],
                [t for t in times if t],
                width,
                label=label,
                color=colour,
            )
        if floor_of is not None:
            for i, shape in enumerate(shapes):
                row = next((c for c in cells if (c["shape"], c["mode"]) == (shape, mode)), None)
                low = floor_of(row) if row else None
                if low:
                    ax.hlines(low, i - 0.45, i + 0.45, colors="red", linestyles="--",
                              label="hardware floor" if i == 0 else None)  # fmt: skip
        ax.set_yscale("log")
        names = [s.replace(" h", "\nh").replace(" ", "\n", 1) for s in shapes]
        ax.set_xticks(range(len(shapes)), names, fontsize=8)
        ax.set_title(MODE_TITLES[mode] + ", bfloat16")
        ax.set_ylabel("median time (ms)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    env = results["environment"]
    fig.suptitle(f"{env['device_kind']}, jax {env['jax']}, {env['date_utc'][:10]}")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(op_dir: str, family_dir: str | None = None) -> None:
    """Redraws the pictures from the committed results.json files."""
    op = json.loads((pathlib.Path(op_dir) / "results.json").read_text())
    op_sweep(op["cells"], str(pathlib.Path(op_dir) / "results.png"))
    if family_dir:
        family = json.loads((pathlib.Path(family_dir) / "results.json").read_text())
        out = pathlib.Path(family_dir)
        training_memory(family["memory"], str(out / "training_memory.png"))
        family_ratios(family["cells"], family["goals"], str(out / "ratios.png"))


if __name__ == "__main__":
    main(*sys.argv[1:])
