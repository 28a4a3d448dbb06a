"""The chunked implementation's plan: how many batch rows a block takes and the query x key
chunk sizes of its tiles, from the shapes and a memory budget (attention/xla_chunked/implementation.py runs the plan).

The working set of a tile is memory.chunked_tile_bytes; `choose_chunk_sizes` keeps it under the
budget and picks the largest useful tile area, `tiling` the block of batch rows that fits
block_bytes with its head-major copies.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from gated_attention.core import checks, memory

# Working-set budget of the tiles when no chunk sizes are given.
DEFAULT_MEMORY_BUDGET_BYTES = memory.DEFAULT_MEMORY_BUDGET_BYTES

# Upper bound on tq * tk per (batch, head): 512 KiB of float32 logits. Larger tiles ran slower on
# CPU at the long shape and pushed the working set past glibc's 32 MiB mmap threshold
# (benchmark_results/ and the commit history of this line have the figures).
_MAX_TILE_ELEMENTS = 512 * 256


class Tiling(NamedTuple):
    """The static shape of one call: what every function of attention/xla_chunked/implementation.py needs besides the arrays."""

    scale: float
    tq: int  # query chunk
    tk: int  # key chunk
    q_len: int  # T, unpadded
    kv_len: int  # S, unpadded
    rows: int  # batch rows per block
    compute_dtype: Any
    soft_cap: float | None = None  # logits -> soft_cap * tanh(logits / soft_cap)
    precision: Any = None  # of the dots

    @property
    def q_pad(self) -> int:
        return -(-self.q_len // self.tq) * self.tq

    @property
    def kv_pad(self) -> int:
        return -(-self.kv_len // self.tk) * self.tk


def tiling(
    batch, heads, q_len, kv_len, head_dim, value_dim, dtype, *, query_chunk_size, key_chunk_size,
    memory_budget_bytes, block_bytes,
) -> tuple[int, int, int]:  # fmt: skip
    """(rows per block, query chunk, key chunk) for [batch, q_len, heads, head_dim] queries: the
    most rows dividing the batch whose working set (memory.chunked_block_row_bytes each) fits
    block_bytes, at least one; the chunks given, else choose_chunk_sizes' for that block."""
    one_row = choose_chunk_sizes(
        1, heads, q_len, kv_len, head_dim, value_dim, dtype, memory_budget_bytes
    )
    per_row = memory.chunked_block_row_bytes(
        heads, q_len, kv_len, *one_row, head_dim, value_dim, dtype
    )
    limit = max(1, min(batch, block_bytes // per_row))
    rows = max(d for d in range(1, limit + 1) if batch % d == 0)
    tq, tk = query_chunk_size, key_chunk_size
    if tq is None or tk is None:
        auto = choose_chunk_sizes(
            rows, heads, q_len, kv_len, head_dim, value_dim, dtype, memory_budget_bytes
        )
        tq, tk = tq or auto[0], tk or auto[1]
    return rows, min(tq, q_len), min(tk, kv_len)


def _candidates(length: int) -> list[int]:
    """Chunk lengths worth trying for a sequence of `length`: itself, its divisors that are
    multiples of 8 or powers of two, and powers of two below it (which need padding)."""
    sizes = {length}
    for d in range(1, length):
        if length % d == 0 and (d % 8 == 0 or d & (d - 1) == 0):
            sizes.add(d)
    p = 1
    while p < length:
        sizes.add(p)
        p *= 2
    return sorted(sizes, reverse=True)


def choose_chunk_sizes(
    batch: int,
    num_heads: int,
    q_len: int,
    kv_len: int,
    head_dim: int,
    value_dim: int,
    dtype: Any,
    memory_budget_bytes: int,
) -> tuple[int, int]:
    """The largest (query_chunk, key_chunk) whose tile working set fits the budget.

    The working set is memory.chunked_tile_bytes (float32 logits tiles for all B * N plus accumulators and
    q/k/v tiles). Candidates per axis are the length itself, its divisors that are multiples of 8
    or powers of two, and smaller powers of two (the lengths are then padded). Among the pairs that
    fit the budget and hold at most _MAX_TILE_ELEMENTS (512 * 256) logits per batch-head, the
    largest useful area wins: tq * tk times the fraction of the padded grid that is real. Ties go
    to less padding, then to squarer tiles, then to the longer key chunk. If nothing fits, (1, 1).

    Args:
      batch: B (the query's batch size).
      num_heads: N.
      q_len: T.
      kv_len: S.
      head_dim: H.
      value_dim: Hv.
      dtype: the inputs' dtype.
      memory_budget_bytes: budget for memory.chunked_tile_bytes.

    Returns:
      (query_chunk, key_chunk), each between 1 and its length.
    """
    for name, v in (
        ("batch", batch),
        ("num_heads", num_heads),
        ("q_len", q_len),
        ("kv_len", kv_len),
        ("head_dim", head_dim),
        ("value_dim", value_dim),
        ("memory_budget_bytes", memory_budget_bytes),
    ):
        checks.check_int(name, v)
    best, best_key = (1, 1), None
    for tq in _candidates(q_len):
        for tk in _candidates(kv_len):
            if tq * tk > _MAX_TILE_ELEMENTS:
                continue
            if (
                memory.chunked_tile_bytes(batch, num_heads, tq, tk, head_dim, value_dim, dtype)
                > memory_budget_bytes
            ):
                continue
            padded = math.ceil(q_len / tq) * tq * math.ceil(kv_len / tk) * tk
            useful_area = tq * tk * (q_len * kv_len / padded)
            key = (useful_area, -padded, -abs(math.log2(tq / tk)), tk)
            if best_key is None or key > best_key:
                best, best_key = (tq, tk), key
    return best
