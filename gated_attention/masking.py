"""Masks described, never materialized: causal, local window and sequence lengths.

jax.nn.dot_product_attention's `is_causal`, `local_window_size`, `query_seq_lengths` and
`key_value_seq_lengths` each mask a regular pattern of (query, key) pairs. A `Structure` describes
them, and every implementation asks it, inside its own tiles:

* `block(q_start, q_size, k_start, k_size)`: the boolean block of one tile, from iotas;
* `key_range(q_start, q_stop, kv_len)` and `query_range(k_start, k_stop, q_len)`: the keys that
  some query of a range may attend (and the converse), so that tiles masked whole are skipped;
* `live(mask, q_len, kv_len)`: which queries have a key to attend to and which keys some query
  attends to, with the explicit mask too, exactly: per position the structure allows an interval
  of the other axis, and a prefix count of the mask tells whether it keeps any of it. Nothing of
  size [B, N, T, S] is built beyond the mask itself (numerics.py zeroes the dead positions and
  gives rows without a key the uniform average).

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


@dataclasses.dataclass(frozen=True)
class Structure:
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

    def rows(self, take) -> Structure:
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
        i = q_start + self._offset() + jax.lax.broadcasted_iota(jnp.int32, (1, q_size, 1), 1)
        j = k_start + jax.lax.broadcasted_iota(jnp.int32, (1, 1, k_size), 2)
        ok = None
        if self.is_causal:
            ok = j <= i
        if self.window is not None:
            left, right = self.window
            ok = _and(ok, (j >= i - left) & (j <= i + right))
        if self.q_lengths is not None:
            ok = _and(ok, i < self.q_lengths[:, None, None])  # [B, q_size, 1|k_size]
        if self.kv_lengths is not None:
            ok = _and(ok, j < self.kv_lengths[:, None, None])  # [B, 1|q_size, k_size]
        return None if ok is None else ok[:, None]

    def key_range(self, q_start, q_stop, kv_len: int):
        """[lo, hi): the keys that some query in [q_start, q_stop) of some row may attend."""
        first, last = q_start + self._offset(), q_stop - 1 + self._offset()
        lo, hi = 0, kv_len
        if self.window is not None:
            lo, hi = max_(lo, first - self.window[0]), min_(hi, last + self.window[1] + 1)
        if self.is_causal:
            hi = min_(hi, last + 1)
        if self.kv_lengths is not None:
            hi = min_(hi, jnp.max(self.kv_lengths))
        if self.q_lengths is not None:
            hi = jnp.where(first < jnp.max(self.q_lengths), hi, lo)
        return lo, max_(hi, lo)

    def query_range(self, k_start, k_stop, q_len: int):
        """[lo, hi): the local queries that some key in [k_start, k_stop) of some row may serve."""
        offset = self._offset()
        lo, hi = offset, offset + q_len  # global positions
        if self.window is not None:
            lo, hi = max_(lo, k_start - self.window[1]), min_(hi, k_stop + self.window[0])
        if self.is_causal:
            lo = max_(lo, k_start)
        if self.q_lengths is not None:
            hi = min_(hi, jnp.max(self.q_lengths))
        if self.kv_lengths is not None:
            hi = jnp.where(k_start < jnp.max(self.kv_lengths), hi, lo)
        lo = lo - offset
        return lo, max_(hi - offset, lo)

    def valid_queries(self, q_len: int):
        """bool [B, T]: the queries within q_lengths (None: all are)."""
        if self.q_lengths is None:
            return None
        i = self._offset() + jnp.arange(q_len, dtype=jnp.int32)[None]  # [1, T]
        return i < self.q_lengths[:, None]

    def full_key_range(self, q_start, q_stop, kv_len: int):
        """[lo, hi): the keys that every query in [q_start, q_stop) of every row may attend, as
        far as this structure says (tiles there need no structured mask)."""
        first, last = q_start + self._offset(), q_stop - 1 + self._offset()
        lo, hi = 0, kv_len
        if self.window is not None:
            lo, hi = max_(lo, last - self.window[0]), min_(hi, first + self.window[1] + 1)
        if self.is_causal:
            hi = min_(hi, first + 1)
        if self.kv_lengths is not None:
            hi = min_(hi, jnp.min(self.kv_lengths))
        if self.q_lengths is not None:
            hi = jnp.where(last < jnp.min(self.q_lengths), hi, lo)
        return lo, max_(hi, lo)

    def full_query_range(self, k_start, k_stop, q_len: int):
        """[lo, hi): the local queries that attend every key in [k_start, k_stop) in every row,
        as far as this structure says."""
        offset = self._offset()
        lo, hi = offset, offset + q_len
        if self.window is not None:
            lo, hi = max_(lo, k_stop - 1 - self.window[1]), min_(hi, k_start + self.window[0] + 1)
        if self.is_causal:
            lo = max_(lo, k_stop - 1)
        if self.q_lengths is not None:
            hi = min_(hi, jnp.min(self.q_lengths))
        if self.kv_lengths is not None:
            hi = jnp.where(k_stop - 1 < jnp.min(self.kv_lengths), hi, lo)
        lo = lo - offset
        return lo, max_(hi - offset, lo)

    def _key_intervals(self, q_len: int, kv_len: int):
        """Per batch row and query, the keys [lo, hi) it may attend: int32 [B|1, T] each."""
        i = self._offset() + jnp.arange(q_len, dtype=jnp.int32)[None]  # [1, T]
        lo, hi = jnp.zeros_like(i), jnp.full_like(i, kv_len)
        if self.window is not None:
            lo, hi = jnp.maximum(lo, i - self.window[0]), jnp.minimum(hi, i + self.window[1] + 1)
        if self.is_causal:
            hi = jnp.minimum(hi, i + 1)
        if self.kv_lengths is not None:
            hi = jnp.minimum(hi, self.kv_lengths[:, None])
        if self.q_lengths is not None:
            hi = jnp.where(i < self.q_lengths[:, None], hi, lo)
        return lo, jnp.maximum(hi, lo)

    def _query_intervals(self, q_len: int, kv_len: int):
        """Per batch row and key, the local queries [lo, hi) that may attend it: [B|1, S] each."""
        offset = self._offset()
        j = jnp.arange(kv_len, dtype=jnp.int32)[None]  # [1, S]
        lo, hi = jnp.full_like(j, 0) + offset, jnp.full_like(j, q_len) + offset
        if self.window is not None:
            lo, hi = jnp.maximum(lo, j - self.window[1]), jnp.minimum(hi, j + self.window[0] + 1)
        if self.is_causal:
            lo = jnp.maximum(lo, j)
        if self.q_lengths is not None:
            hi = jnp.minimum(hi, self.q_lengths[:, None])
        if self.kv_lengths is not None:
            hi = jnp.where(j < self.kv_lengths[:, None], hi, lo)
        lo = lo - offset
        return lo, jnp.maximum(hi - offset, lo)

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
    Structure,
    data_fields=["q_lengths", "kv_lengths", "q_offset"],
    meta_fields=["is_causal", "window"],
)

NONE = Structure()
