"""Masks described, never materialized: causal, local window and sequence lengths.

jax.nn.dot_product_attention's `is_causal`, `local_window_size`, `query_seq_lengths` and
`key_value_seq_lengths` each mask a regular pattern of (query, key) pairs. A `StructuredMask` describes
them, and every implementation asks it, inside its own tiles:

* `block(q_start, q_size, k_start, k_size)`: the boolean block of one tile, from iotas;
* `key_range(q_start, q_stop, kv_len)` and `query_range(k_start, k_stop, q_len)`: the keys that
  some query of a range may attend (and the converse; every=True: each query), so that tiles
  masked whole are skipped and tiles kept whole build no mask;
* `live(mask, q_len, kv_len)`: which queries have a key to attend to and which keys some query
  attends to, with the explicit mask too, exactly: per position the structure allows an interval
  of the other axis, and a prefix count of the mask tells whether it keeps any of it. Nothing of
  size [B, N, T, S] is built beyond the mask itself (numerics.py zeroes the dead positions and
  gives rows without a key the uniform average).

All of them, and the Pallas kernels (which read one row's lengths from a meta ref), derive the
ranges from one rule: `allowed(i, j, ...)` pointwise, `key_span` and its converse `query_span` for
ranges, `tiles` for the tiles a range touches.

Conventions (jax.nn's; positions counted from 0 at the top left whatever T and S): query i of
batch row b may attend key j iff
  j <= i                                   is_causal
  i - left <= j <= i + right               window = (left, right)
  i < q_lengths[b] and j < kv_lengths[b]   sequence lengths
and the explicit mask (True = attend) allows it too. `q_offset` is the position of the first
local query when the queries are split over devices (sharding.shard_attention).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


def min_(a, b):
    """min of ints or traced int scalars."""
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.minimum(a, b)


def max_(a, b):
    """max of ints or traced int scalars."""
    return max(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.maximum(a, b)


def _and(a, b):
    return b if a is None else a & b


# ------------------------------------------------------------------------------------------------
# The one rule. Query i may attend key j iff lower <= j - i <= upper (the band of the causal and
# window masks), i < q_length and j < kv_length. Everything else here, the Pallas kernels and the
# chunked tiles derive their masks and their skipped tiles from these functions.


def diagonals(is_causal: bool, window: tuple[int, int] | None):
    """(lower, upper): the band lower <= j - i <= upper of the causal and window masks; None
    where unbounded."""
    lower = None if window is None else -window[0]
    upper = None if window is None else window[1]
    if is_causal:
        upper = 0 if upper is None else min(upper, 0)
    return lower, upper


def allowed(i, j, is_causal: bool, window, q_length=None, kv_length=None):
    """bool: whether query position i may attend key position j (arrays broadcast; lengths
    None: unbounded). None when nothing is masked. The band is compared as j against i's
    bounds (vectors of a tile's rows), never as j - i (a tile-sized temporary: registers in
    the GPU kernel)."""
    lower, upper = diagonals(is_causal, window)
    ok = None
    if q_length is not None:
        ok = i < q_length
    if kv_length is not None:
        ok = _and(ok, j < kv_length)
    if lower is not None:
        ok = _and(ok, j >= i + lower)
    if upper is not None:
        ok = _and(ok, j <= i + upper)
    return ok


def _span(first, last, lower, upper, start, stop, every: bool):
    """[lo, hi) within [start, stop): the positions p with lower <= p - x <= upper for some x in
    [first, last] (every: for each x); hi == lo when empty."""
    a, b = (last, first) if every else (first, last)
    lo = start if lower is None else max_(start, a + lower)
    hi = stop if upper is None else min_(stop, b + upper + 1)
    return lo, max_(hi, lo)


def _gate(keep, stop, empty):
    """stop where `keep` holds, else empty (a range that then holds nothing)."""
    if isinstance(keep, bool):
        return stop if keep else empty
    return jnp.where(keep, stop, empty)


def key_span(
    first, last, is_causal, window, kv_len: int, q_length=None, kv_length=None, every=False
):
    """[lo, hi): the keys that some query (every: each query) at positions [first, last] may
    attend. Lengths: None, or values that broadcast with first (one row's, or [B, 1])."""
    lower, upper = diagonals(is_causal, window)
    stop = kv_len if kv_length is None else min_(kv_len, kv_length)
    if q_length is not None:  # a query at or past its row's length attends nothing
        stop = _gate((last if every else first) < q_length, stop, 0)
    return _span(first, last, lower, upper, 0, stop, every)


def query_span(
    k_first, k_last, is_causal, window, q_start, q_len: int, q_length=None, kv_length=None,
    every=False,
):  # fmt: skip
    """[lo, hi): the query positions in [q_start, q_start + q_len) that attend some key (every:
    each key) at positions [k_first, k_last]: key_span's converse."""
    lower, upper = diagonals(is_causal, window)
    stop = q_start + q_len if q_length is None else min_(q_start + q_len, q_length)
    if kv_length is not None:  # a key at or past its row's length is attended by nothing
        stop = _gate((k_last if every else k_first) < kv_length, stop, q_start)
    flip = lambda d: None if d is None else -d
    return _span(k_first, k_last, flip(upper), flip(lower), q_start, stop, every)


def key_tiles(first, block_q: int, block_k: int, is_causal, window, kv_len: int, q_length=None,
              kv_length=None):  # fmt: skip
    """[lo, hi): the tiles of block_k keys that some query of the block_q queries from position
    `first` may attend: what a kernel's loop over key tiles runs (one row's lengths)."""
    lo, hi = key_span(first, first + block_q - 1, is_causal, window, kv_len, q_length, kv_length)
    return tiles(lo, hi, block_k)


def query_tiles(k_first, block_k: int, block_q: int, is_causal, window, offset, q_len: int,
                q_length=None, kv_length=None):  # fmt: skip
    """[lo, hi): the tiles of block_q local queries (position offset + local index) with a query
    that may attend some of the block_k keys from `k_first`: key_tiles' converse."""
    lo, hi = query_span(
        k_first, k_first + block_k - 1, is_causal, window, offset, q_len, q_length, kv_length
    )
    return tiles(lo - offset, hi - offset, block_q)


def tiles(lo, hi, size: int):
    """[first, stop): the tiles of `size` positions that [lo, hi) touches (first == stop when
    it is empty); ints stay ints, traced values give int32."""
    if isinstance(lo, int) and isinstance(hi, int):
        return (lo // size, -(-hi // size)) if hi > lo else (lo // size, lo // size)
    lo, hi = jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32)
    first = lo // size
    return first, jnp.where(hi > lo, -(-hi // size), first)


@dataclasses.dataclass(frozen=True)
class StructuredMask:
    """Causal, window and length masks of one call (a pytree: the lengths are its leaves).

    Attributes:
      is_causal: query i attends keys j <= i.
      window: None or (left, right), ints >= 0: query i attends keys in [i - left, i + right].
      q_lengths: None or int32 [B]: queries at or beyond q_lengths[b] attend nothing.
      kv_lengths: None or int32 [B]: keys at or beyond kv_lengths[b] are attended by nothing.
      q_offset: None (0) or an int32 scalar: the position of local query 0.
    """

    is_causal: bool = False
    window: tuple[int, int] | None = None
    q_lengths: Any = None
    kv_lengths: Any = None
    q_offset: Any = None

    @property
    def trivial(self) -> bool:
        """Whether it masks nothing."""
        return not self.is_causal and self.window is None and not self.has_lengths

    @property
    def has_lengths(self) -> bool:
        return self.q_lengths is not None or self.kv_lengths is not None

    def rows(self, take) -> StructuredMask:
        """The structure of some batch rows: take(x) selects them from a [B] length array."""
        q, kv = (None if x is None else take(x) for x in (self.q_lengths, self.kv_lengths))
        return dataclasses.replace(self, q_lengths=q, kv_lengths=kv)

    def meta(self, batch: int) -> jax.Array:
        """int32 [B, 3]: per batch row its first query's position, its query length and its key
        length (a length absent: 2^30), what the Pallas kernels read of the structure."""
        whole = jnp.full((batch,), 2**30, jnp.int32)
        offset = jnp.zeros((batch,), jnp.int32) + jnp.asarray(self._offset(), jnp.int32)
        columns = [
            offset,
            whole if self.q_lengths is None else self.q_lengths.astype(jnp.int32),
            whole if self.kv_lengths is None else self.kv_lengths.astype(jnp.int32),
        ]
        return jnp.stack([jnp.broadcast_to(c, (batch,)) for c in columns], axis=1)

    def _offset(self):
        return 0 if self.q_offset is None else self.q_offset

    def block(self, q_start, q_size: int, k_start, k_size: int) -> jax.Array | None:
        """bool [B|1, 1, q_size|1, k_size|1]: True where query q_start + a may attend key k_start + c.

        None when the structure masks nothing. q_start and k_start may be traced (tile loops).
        """
        if self.trivial:
            return None
        i = q_start + self._offset() + jax.lax.broadcasted_iota(jnp.int32, (1, q_size, 1), 1)
        j = k_start + jax.lax.broadcasted_iota(jnp.int32, (1, 1, k_size), 2)
        q_lengths, kv_lengths = (
            None if x is None else x[:, None, None] for x in (self.q_lengths, self.kv_lengths)
        )
        ok = allowed(i, j, self.is_causal, self.window, q_lengths, kv_lengths)
        return ok[:, None]

    def key_range(self, q_start, q_stop, kv_len: int, every: bool = False):
        """[lo, hi): the keys that some query (every: each query) in local [q_start, q_stop) of
        some row (every: of each row) may attend (key_span)."""
        first, last = q_start + self._offset(), q_stop - 1 + self._offset()
        q_length, kv_length = self._lengths(every)
        return key_span(
            first, last, self.is_causal, self.window, kv_len, q_length, kv_length, every
        )

    def query_range(self, k_start, k_stop, q_len: int, every: bool = False):
        """[lo, hi): the local queries that some key (every: each key) in [k_start, k_stop) of
        some row (every: of each row) may serve (query_span)."""
        q_length, kv_length = self._lengths(every)
        offset = self._offset()
        lo, hi = query_span(
            k_start, k_stop - 1, self.is_causal, self.window, offset, q_len, q_length, kv_length,
            every,
        )  # fmt: skip
        return lo - offset, hi - offset

    def _lengths(self, every: bool):
        """The lengths that bound a range over all rows: the longest (some row), or the
        shortest (every row)."""
        reduce = jnp.min if every else jnp.max
        return (None if x is None else reduce(x) for x in (self.q_lengths, self.kv_lengths))

    def valid_queries(self, q_len: int):
        """bool [B, T]: the queries within q_lengths (None: all are)."""
        if self.q_lengths is None:
            return None
        i = self._offset() + jnp.arange(q_len, dtype=jnp.int32)[None]  # [1, T]
        return i < self.q_lengths[:, None]

    def _key_intervals(self, q_len: int, kv_len: int):
        """Per batch row and query, the keys [lo, hi) it may attend: int32 [B|1, T] each."""
        i = self._offset() + jnp.arange(q_len, dtype=jnp.int32)[None]  # [1, T]
        q_length, kv_length = self._row_lengths()
        return _full(i, *key_span(i, i, self.is_causal, self.window, kv_len, q_length, kv_length))

    def _query_intervals(self, q_len: int, kv_len: int):
        """Per batch row and key, the local queries [lo, hi) that may attend it: [B|1, S] each."""
        j = jnp.arange(kv_len, dtype=jnp.int32)[None]  # [1, S]
        q_length, kv_length = self._row_lengths()
        offset = self._offset()
        lo, hi = query_span(j, j, self.is_causal, self.window, offset, q_len, q_length, kv_length)
        return _full(j, lo - offset, hi - offset)

    def _row_lengths(self):
        return (None if x is None else x[:, None] for x in (self.q_lengths, self.kv_lengths))

    def live(self, mask, q_len: int, kv_len: int):
        """(live queries [B|1, N|1, T], live keys [B|1, N|1, S]), bool, or (None, None).

        A live query has at least one key to attend to under the mask (None or bool
        [B|1, N|1, T|1, S|1]) and this structure; a live key is attended by at least one query.
        """
        if self.trivial:
            if mask is None:
                return None, None
            return jnp.any(mask, axis=3), jnp.any(mask, axis=2)
        k_lo, k_hi = self._key_intervals(q_len, kv_len)
        q_lo, q_hi = self._query_intervals(q_len, kv_len)
        if mask is None:
            return (k_hi > k_lo)[:, None], (q_hi > q_lo)[:, None]
        return _any_between(mask, 3, k_lo, k_hi), _any_between(mask, 2, q_lo, q_hi)


def _full(positions, lo, hi):
    """lo and hi as int32 arrays of one shape, with the positions' axis whole."""
    shape = jnp.broadcast_shapes(positions.shape, jnp.shape(lo), jnp.shape(hi))
    return tuple(jnp.broadcast_to(jnp.asarray(x, jnp.int32), shape) for x in (lo, hi))


def _any_between(mask, axis: int, lo, hi):
    """Whether mask keeps any position in [lo, hi) along `axis` (3: keys, 2: queries).

    mask: bool [B|1, N|1, T|1, S|1]; lo, hi: int32 [B|1, L], L the other axis's length.
    Returns bool [B|1, N|1, L]: a prefix count of the mask (its own size, int32) read at lo and
    hi, so no array larger than the mask is made.
    """
    if mask.shape[axis] == 1:
        return jnp.moveaxis(mask, axis, -1)[..., 0] & (hi > lo)[:, None]
    counts = jnp.cumsum(mask.astype(jnp.int32), axis=axis)
    widths = [(0, 0)] * 4
    widths[axis] = (1, 0)
    counts = jnp.pad(counts, widths)  # counts[..., x] = number of kept positions before x
    at = lambda index: jnp.take_along_axis(counts, jnp.expand_dims(index, (1, axis)), axis=axis)
    return jnp.moveaxis(at(hi) - at(lo) > 0, axis, -1)[..., 0]


jax.tree_util.register_dataclass(
    StructuredMask,
    data_fields=["q_lengths", "kv_lengths", "q_offset"],
    meta_fields=["is_causal", "window"],
)

NONE = StructuredMask()
