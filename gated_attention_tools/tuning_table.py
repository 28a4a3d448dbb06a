"""The table 'auto' reads first on a GPU (gated_attention/attention/tuning.json), from device runs: per
device kind, dtype, mode and sequence class, which of our implementations a run timed fastest.

  python -m gated_attention_tools.tuning_table benchmark_results/device/h100/results.json

reads the op cells of each run (ours: IMPLEMENTATIONS below, 'auto' left out), groups them by
dtype, mode ('forward' / 'training') and whether the sequence is longer than tuning.LONG, and per
group takes the implementation with the least geometric mean of its time over the fastest's
across the group's shapes (one that did not run in a shape is out of that group). The head dims
measured bound the entry (max_head_dim). The table for each device kind named in the runs is
replaced; other kinds stay.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from gated_attention.attention import tuning

IMPLEMENTATIONS = ("mosaic", "pallas", "cudnn", "xla")  # what Auto may take on a GPU
MODES = {"forward": "forward", "forward_backward": "training"}


def entries(results: dict) -> list[dict]:
    """The table entries one device run's results give."""
    groups: dict[tuple, dict[str, dict[str, float]]] = {}
    for row in results["cells"]:
        if row["level"] != "op" or row["variant"] not in IMPLEMENTATIONS or not row.get("time_ms"):
            continue
        dims = row["shape_dims"]
        long = dims["length"] > tuning.LONG  # the device cells attend T = S
        key = (row["dtype"], MODES[row["mode"]], long, dims["head_dim"])
        groups.setdefault(key, {}).setdefault(row["shape"], {})[row["variant"]] = row["time_ms"]
    source = f"{results['environment']['device_kind']}, jax {results['environment']['jax']}, "
    source += results["environment"]["date_utc"][:10]
    out = []
    for (dtype, mode, long, head_dim), shapes in sorted(groups.items()):
        everywhere = set.intersection(*(set(t) for t in shapes.values()))
        score = {
            impl: math.exp(
                sum(math.log(t[impl] / min(t.values())) for t in shapes.values()) / len(shapes)
            )
            for impl in everywhere
        }
        best = min(sorted(score), key=score.get)
        out.append(
            dict(
                dtype=dtype, mode=mode, long=long, max_head_dim=head_dim, implementation=best,
                measured=f"{source}: {', '.join(sorted(shapes))}",
            )
        )  # fmt: skip
    return out


def device_name(kind: str) -> str:
    """The table's key for a JAX device kind: its word that names the chip ('H100')."""
    words = kind.upper().replace("-", " ").split()
    return next(w for w in words if any(c.isdigit() for c in w) and w[0].isalpha())


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.exit("usage: python -m gated_attention_tools.tuning_table RESULTS_JSON...")
    table = json.loads(tuning.TABLE_FILE.read_text()) if tuning.TABLE_FILE.exists() else {}
    for path in argv[1:]:
        results = json.loads(Path(path).read_text())
        table[device_name(results["environment"]["device_kind"])] = entries(results)
    tuning.TABLE_FILE.write_text(json.dumps(table, indent=2, sort_keys=True) + "\n")
    print(json.dumps(table, indent=2, sort_keys=True))
    print(f"wrote {tuning.TABLE_FILE}")


if __name__ == "__main__":
    main(sys.argv)
