"""Where we stand on a device, per level, from a device run's results.json: the table README.md and
docs/gpu_tpu.md quote (tests/test_docs.py checks they quote it as this module writes it).

    python -m gated_attention_tools.device_summary benchmark_results/device/h100/results.json

Each figure is ours ('auto' at the op level, the Attention module at the module level) over the
peer, median time over median time in one run, bfloat16; a range spans AF2's shapes (the MSA row and
the triangle cells). A peer or level the run did not time says so.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# Peers at the op level, as the device benchmark names them, with what they ran.
OP_PEERS = (
    (
        "af2_colabfold",
        "ColabFold's kernel (`tri_flash`, colabfold-kernels 0.9.0, `use_pallas=True`)",
    ),
    ("jax_nn_cudnn", "jax.nn's cuDNN attention"),
    ("jax_nn_xla", "jax.nn's XLA attention"),
)
MODES = ("forward", "forward_backward")
LONG = "long"  # the one-sequence cell, apart from AF2's shapes


def _times(cells: list[dict], level: str) -> dict:
    """{(shape, mode): {variant: median ms}} of the bfloat16 cells that were timed."""
    found: dict = {}
    for c in cells:
        if c["level"] == level and c["dtype"] == "bfloat16" and c.get("time_ms"):
            found.setdefault((c["shape"], c["mode"]), {})[c["variant"]] = c["time_ms"]
    return found


def _span(ratios: list[float]) -> str:
    if not ratios:
        return "not measured"
    low, high = min(ratios), max(ratios)
    return f"{low:.2f}x" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}-{high:.2f}x"


def _ratios(times: dict, ours: str, peer: str, mode: str, long: bool) -> list[float]:
    return [
        t[ours] / t[peer]
        for (shape, m), t in times.items()
        if m == mode and shape.startswith(LONG) == long and ours in t and peer in t
    ]


def table(results: dict) -> str:
    """The markdown table: a caption line naming the device, then one row per level and peer."""
    env = results["environment"]
    op, module = _times(results["cells"], "op"), _times(results["cells"], "module")
    lines = [
        f"Measured on one {env['device_kind']} (jax {env['jax']}, {env['date_utc'][:10]}), "
        "bfloat16: our time / the peer's (below 1: ours is faster).",
        "",
        "| level: ours / peer | inference, AF2's shapes | training step, AF2's shapes "
        "| inference, one sequence of 16,384 | training step, one sequence of 16,384 |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for peer, name in OP_PEERS:
        spans = [_span(_ratios(op, "auto", peer, m, long)) for long in (False, True) for m in MODES]
        lines.append(f"| op: {name} | " + " | ".join(spans) + " |")
    spans = [
        _span(_ratios(module, "ours", "af2", m, long)) for long in (False, True) for m in MODES
    ]
    lines.append(
        "| Attention module: AF2's module as installed (XLA attention) | "
        + " | ".join(spans)
        + " |"
    )
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        sys.exit(
            f"usage: python -m gated_attention_tools.device_summary RESULTS_JSON, got {argv[1:]}"
        )
    print(table(json.loads(Path(argv[1]).read_text())))


if __name__ == "__main__":
    main(sys.argv)
