"""What the device runs measured fastest, per device kind: the table 'auto' reads first on a GPU.

tuning.json beside this module holds, per device kind (a word of JAX's device kind: 'H100'),
entries {dtype, mode, max_head_dim, long, implementation, measured} and, from a sweep of the
tuning candidates (gated_attention_tools/sweep.py), {bias, options, candidate} too: among this
library's implementations and their candidates (attention/candidates.py), the one a device run
timed fastest for that dtype, mode ('forward': inference; 'training': the forward and backward of
a training step), head dims up to max_head_dim, sequences longer than LONG or not, and the bias
class (`bias_class`); `options`, the fields 'auto' builds the implementation with.
gated_attention_tools/tuning_table.py writes it from a device run's results; where it has no entry
'auto' applies its rules (attention.Auto).

Entries written before the sweep (the H100's of 2026-11-26) have no bias, options or candidate:
they match any bias class and build the implementation as it is. Where several entries match, the
one of the least max_head_dim is taken, then the one naming the bias class.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

TABLE_FILE = Path(__file__).with_name("tuning.json")
MODES = ("forward", "training")
LONG = 4096  # tokens: beyond it a sequence is 'long' (its own entries)
BIAS_CLASSES = ("none", "shared", "per_row", "both")


@functools.cache
def table() -> dict[str, list[dict]]:
    return json.loads(TABLE_FILE.read_text())


def bias_class(biases) -> str:
    """'shared' (every bias has batch dimension 1: AF2's pair bias), 'per_row' (none has), 'both'
    or 'none' (no bias), for [B|1, N|1, T|1, S|1] biases."""
    shared = any(b.shape[0] == 1 for b in biases)
    per_row = any(b.shape[0] != 1 for b in biases)
    return {(True, True): "both", (True, False): "shared", (False, True): "per_row"}.get(
        (shared, per_row), "none"
    )


def choice(
    device_kind: str | None, dtype, head_dim: int, length: int, bias: str | None = None
) -> dict[str, dict[str, Any]] | None:
    """{mode: {implementation, options, candidate}} measured fastest on this device for these
    inputs (bias: their bias_class; None matches entries of any), for both modes, or None (an
    unknown device or a class no run measured). `options` is {} and `candidate` the
    implementation's name for entries that record none."""
    if not device_kind:
        return None
    if bias is not None and bias not in BIAS_CLASSES:
        raise ValueError(f"bias must be one of {BIAS_CLASSES} or None, got {bias!r}")
    words = set(device_kind.upper().replace("-", " ").split())
    entries = next((v for k, v in table().items() if k in words), None)
    if entries is None:
        return None
    found = {}
    for e in entries:
        if (
            e["dtype"] != str(dtype)
            or head_dim > e["max_head_dim"]
            or e["long"] != (length > LONG)
            or ("bias" in e and bias is not None and e["bias"] != bias)
        ):
            continue
        rank = (e["max_head_dim"], "bias" not in e)  # the tightest class, then the named bias
        if e["mode"] not in found or rank < found[e["mode"]][0]:
            found[e["mode"]] = (rank, e)
    if set(found) != set(MODES):
        return None
    return {
        mode: dict(
            implementation=e["implementation"],
            options=dict(e.get("options", {})),
            candidate=e.get("candidate", e["implementation"]),
        )
        for mode, (_, e) in found.items()
    }


def lookup(device_kind: str | None, dtype, head_dim: int, length: int) -> dict[str, str] | None:
    """{mode: implementation name} of `choice` (any bias class)."""
    found = choice(device_kind, dtype, head_dim, length)
    return None if found is None else {m: c["implementation"] for m, c in found.items()}
