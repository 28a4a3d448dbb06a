"""What the device runs measured fastest, per device kind: the table 'auto' reads first on a GPU.

tuning.json beside this module holds, per device kind (a word of JAX's device kind: 'H100'),
entries {dtype, mode, max_head_dim, long, implementation, measured}: among this library's
implementations, the one a device run timed fastest for that dtype, mode ('forward': inference;
'training': the forward and backward of a training step), head dims up to max_head_dim and
sequences longer than LONG or not. gated_attention_tools/tuning_table.py writes it from a device
run's results; where it has no entry 'auto' applies its rules (attention.Auto).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

TABLE_FILE = Path(__file__).with_name("tuning.json")
MODES = ("forward", "training")
LONG = 4096  # tokens: beyond it a sequence is 'long' (its own entries)


@functools.cache
def table() -> dict[str, list[dict]]:
    return json.loads(TABLE_FILE.read_text())


def lookup(device_kind: str | None, dtype, head_dim: int, length: int) -> dict[str, str] | None:
    """{mode: implementation name} measured fastest on this device for these inputs, for both
    modes, or None (an unknown device or a class no run measured)."""
    if not device_kind:
        return None
    words = set(device_kind.upper().replace("-", " ").split())
    entries = next((v for k, v in table().items() if k in words), None)
    if entries is None:
        return None
    found = {}
    for e in entries:
        if (
            e["dtype"] == str(dtype)
            and head_dim <= e["max_head_dim"]
            and e["long"] == (length > LONG)
        ):
            found[e["mode"]] = e["implementation"]
    return found if set(found) == set(MODES) else None
