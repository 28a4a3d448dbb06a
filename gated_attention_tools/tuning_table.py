"""The table 'auto' reads first on a GPU (gated_attention/attention/tuning.json), from device runs: per
device kind, dtype, mode and shape class, which of our implementations (and, from a sweep, which
of their tuning candidates) a run timed fastest.

  python -m gated_attention_tools.tuning_table benchmark_results/device/h100/results.json
  python -m gated_attention_tools.tuning_table benchmark_results/device/h100/sweep/results.json
  python -m gated_attention_tools.tuning_table RESULTS_JSON... --out=/tmp/tuning.json

reads the op cells of each run: a device benchmark's rows of our implementations (IMPLEMENTATIONS
below, 'auto' left out), or a sweep's rows (gated_attention_tools/sweep.py: each a candidate, its
implementation and options; one whose result disagreed with the float32 reference is left out,
and a peer's, tokamax's or ColabFold's behind our contract, only where it was checked and agreed).
It groups them by dtype, mode ('forward' / 'training'), whether the sequence is longer than
tuning.LONG, the head dim and, for a sweep, the bias class (the cells' pair bias shared over the
batch, or none), and per group takes the candidate with the least geometric mean of its time over
the fastest's across the group's shapes (one that did not run in a shape is out of that group;
a group where none ran in every shape gets no entry). The head dim bounds the entry
(max_head_dim); a sweep's entries record the bias class, the candidate's name and its options,
which 'auto' builds the implementation with. The table for each device kind named in the runs
is replaced; other kinds stay. --out writes the table there instead of the package's tuning.json.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from gated_attention.attention import candidates, tuning

IMPLEMENTATIONS = candidates.OURS  # a device benchmark's rows of ours (its peers' are not ours)
SWEPT = candidates.GPU  # a sweep's candidates: ours and the peers behind our contract
PEERS = candidates.PEERS
MODES = {"forward": "forward", "forward_backward": "training"}


def _candidate(row: dict) -> tuple[str, str, dict] | None:
    """(candidate name, implementation, options) of a timed op row of ours, or None."""
    if row["level"] != "op" or not row.get("time_ms"):
        return None
    if "implementation" in row:  # a sweep's row: its candidate
        if row.get("accurate") is False or row["implementation"] not in SWEPT:
            return None
        if row["implementation"] in PEERS and row.get("accurate") is not True:
            return None  # a peer only where checked against the float32 reference
        return row["variant"], row["implementation"], dict(row.get("options", {}))
    if row["variant"] in IMPLEMENTATIONS:  # a device benchmark's row: the instance as it is
        return row["variant"], row["variant"], {}
    return None


def entries(results: dict) -> list[dict]:
    """The table entries one device run's results give."""
    groups: dict[tuple, dict[str, dict[str, float]]] = {}
    found: dict[str, tuple[str, dict]] = {}
    for row in results["cells"]:
        named = _candidate(row)
        if named is None:
            continue
        name, implementation, options = named
        found[name] = (implementation, options)
        dims = row["shape_dims"]
        long = dims["length"] > tuning.LONG  # the device cells attend T = S
        bias = ("shared" if dims.get("bias", True) else "none") if "implementation" in row else ""
        key = (row["dtype"], MODES[row["mode"]], long, dims["head_dim"], bias)
        groups.setdefault(key, {}).setdefault(row["shape"], {})[name] = row["time_ms"]
    source = f"{results['environment']['device_kind']}, jax {results['environment']['jax']}, "
    source += results["environment"]["date_utc"][:10]
    out = []
    for (dtype, mode, long, head_dim, bias), shapes in sorted(groups.items()):
        everywhere = set.intersection(*(set(t) for t in shapes.values()))
        if not everywhere:
            continue
        score = {
            name: math.exp(
                sum(math.log(t[name] / min(t.values())) for t in shapes.values()) / len(shapes)
            )
            for name in everywhere
        }
        best = min(sorted(score), key=score.get)
        implementation, options = found[best]
        entry = dict(
            dtype=dtype, mode=mode, long=long, max_head_dim=head_dim,
            implementation=implementation, measured=f"{source}: {', '.join(sorted(shapes))}",
        )  # fmt: skip
        if bias:  # a sweep's: the bias class and the candidate
            entry |= dict(bias=bias, candidate=best, options=options)
        out.append(entry)
    return out


def device_name(kind: str) -> str:
    """The table's key for a JAX device kind: its word that names the chip ('H100'; a kind
    without one, its first word: 'CPU' for a smoke run's)."""
    words = kind.upper().replace("-", " ").split()
    return next((w for w in words if any(c.isdigit() for c in w) and w[0].isalpha()), words[0])


def updated(table: dict, results: list[dict]) -> dict:
    """`table` with each run's device kind's entries replaced by that run's."""
    table = dict(table)
    for run in results:
        table[device_name(run["environment"]["device_kind"])] = entries(run)
    return table


def write(path: Path, table: dict) -> None:
    Path(path).write_text(json.dumps(table, indent=2, sort_keys=True) + "\n")


def main(argv: list[str]) -> None:
    paths = [a for a in argv[1:] if not a.startswith("--out=")]
    outs = [a.removeprefix("--out=") for a in argv[1:] if a.startswith("--out=")]
    if not paths or len(outs) > 1:
        sys.exit("usage: python -m gated_attention_tools.tuning_table RESULTS_JSON... [--out=PATH]")
    out = Path(outs[0]) if outs else tuning.TABLE_FILE
    table = json.loads(tuning.TABLE_FILE.read_text()) if tuning.TABLE_FILE.exists() else {}
    table = updated(table, [json.loads(Path(p).read_text()) for p in paths])
    write(out, table)
    print(json.dumps(table, indent=2, sort_keys=True))
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv)
