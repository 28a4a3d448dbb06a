"""Memory-efficient attention: online softmax over query and key tiles, with a tiled backward.

Rabe & Staats (2021), "Self-attention does not need O(n^2) memory", in the FlashAttention-2 form.
`ChunkedAttention` loops over blocks of batch rows (outer): each block is brought to head-major
layout [r, N, T, H] in the compute dtype, its masked positions zeroed (numerics.py), and attended
in query x key tiles; no copy of the whole query, key or value is made. Within a block the forward
loops over query chunks and key chunks, carrying per query row the sum of exp(logit - m) and the
float32 output accumulator; it never holds more than one [r, N, tq, tk] tile of logits. The shift m
is first a fixed upper bound on the row's logits (from |q| max|k| and the bias's row maximum), which
saves the running maximum and the rescaling after every key tile; a block of rows where that bound
is so loose that the sum nears underflow is recomputed with the running maximum (see _forward).

The backward (a `jax.custom_vjp` over the whole call) saves only the inputs, the output and the
per-row softmax statistics (m and the sum; m + log(sum) is the logsumexp), and recomputes the
probabilities block by block, tile by tile, key chunks outer and query chunks inner:
D = rowsum(dO * O); per tile p = exp(s - lse), dv += p^T dO, dp = dO v^T, ds = p * (dp - D)
(times the soft cap's derivative; zero where masked), dq += ds k, dk += ds^T q, dbias += ds summed
to the bias's own shape. The logsumexp is also returned (return_residual), without gradient.

The causal, window and length masks (masking.Structure) are built per tile from iotas, and only
where a tile is masked in part: forward and backward skip the tiles they mask whole and build no
mask in the tiles they keep whole (_Runs), so a causal call does about half the work. Grouped-query
attention (K key/value heads under N query heads) gives the query side a group axis,
[r, K, G, T, H], and contracts it with the key side [r, K, S, H] (base.Groups): no key or value is
repeated, and dk, dv sum over the group in the einsums.

Numerics are those of xla.py (the specification), through numerics.py: logits accumulate in float32
(float64 for float64 inputs), the same masking in forward and backward, and a fully masked row is
the uniform average of the values. For float32/float64 inputs the scale multiplies the query tile
before the dot rather than the logits after it (see _logits).

Einsum letters: b batch, n heads (key/value heads when grouped), g query heads of a group, q query
positions, k key positions, h per-head channel.

Chunk sizes that do not divide the lengths are handled by padding each block: padded keys get the
logit -1e30, far below the mask value, so they never take weight even in a fully masked row; padded
query rows are sliced off.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gated_attention import base, checks, mapping, masking, numerics
from gated_attention.numerics import MASK_VALUE, accumulation_dtype

# Logit of padded keys: exp(_PAD_VALUE - MASK_VALUE) == 0, so padding never takes weight.
_PAD_VALUE = -1e30

# Working-set budget of the tiles when no chunk sizes are given (and of 'auto''s limits).
DEFAULT_MEMORY_BUDGET_BYTES = 256 * 2**20

# Upper bound on tq * tk per (batch, head): 512 KiB of float32 logits. Larger tiles ran slower on
# CPU at the long shape and pushed the working set past glibc's 32 MiB mmap threshold
# (benchmark_results/ and the commit history of this line have the figures).
_MAX_TILE_ELEMENTS = 512 * 256

# Number of float32 [B, N, tq, tk] buffers live at once in the tiled backward (p, dp, ds), which is
# also enough for the forward (logits, probabilities).
_TILE_BUFFERS = 3


@dataclasses.dataclass(frozen=True)
class ChunkedAttention(base.Implementation):
    """Online-softmax attention in blocks of batch rows and query x key tiles.

    Attributes:
      query_chunk_size: query rows per tile (clipped to T); None: from `choose_chunk_sizes`.
      key_chunk_size: keys per tile (clipped to S); None: from `choose_chunk_sizes`.
      memory_budget_bytes: budget of a block's tiles (`tile_bytes`) when choosing chunk sizes.
      block_bytes: target working set of one block of batch rows (its head-major copies and
        tiles); at least one row a block.
    """

    name = "chunked"
    TAKES = base.ALL_OPTIONS
    query_chunk_size: int | None = None
    key_chunk_size: int | None = None
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES
    block_bytes: int = 16 * 2**20

    def __post_init__(self):
        checks.check_int("query_chunk_size", self.query_chunk_size, optional=True)
        checks.check_int("key_chunk_size", self.key_chunk_size, optional=True)
        checks.check_int("memory_budget_bytes", self.memory_budget_bytes)
        checks.check_int("block_bytes", self.block_bytes)

    def tiling(self, batch, heads, q_len, kv_len, head_dim, value_dim, dtype) -> tuple[int, ...]:
        """(rows per block, query chunk, key chunk) for [batch, q_len, heads, head_dim] queries."""
        one_row = choose_chunk_sizes(
            1, heads, q_len, kv_len, head_dim, value_dim, dtype, self.memory_budget_bytes
        )
        copies = heads * (q_len + kv_len) * (head_dim + value_dim) * jnp.dtype(dtype).itemsize
        per_row = tile_bytes(1, heads, *one_row, head_dim, value_dim, dtype) + copies
        limit = max(1, min(batch, self.block_bytes // per_row))
        rows = max(d for d in range(1, limit + 1) if batch % d == 0)
        tq, tk = self.query_chunk_size, self.key_chunk_size
        if tq is None or tk is None:
            auto = choose_chunk_sizes(
                rows, heads, q_len, kv_len, head_dim, value_dim, dtype, self.memory_budget_bytes
            )
            tq, tk = tq or auto[0], tk or auto[1]
        return rows, min(tq, q_len), min(tk, kv_len)

    def __call__(
        self, query, key, value, biases, mask, *, scale, compute_dtype, options=base.PLAIN
    ):
        batch, q_len, heads, head_dim = query.shape
        kv_len, value_dim = key.shape[1], value.shape[-1]
        rows, tq, tk = self.tiling(batch, heads, q_len, kv_len, head_dim, value_dim, compute_dtype)
        tiling = _Tiling(
            float(scale),
            tq,
            tk,
            q_len,
            kv_len,
            rows,
            jnp.dtype(compute_dtype),
            options.logits_soft_cap,
            options.precision,
        )
        out, lse = _attention(query, key, value, tuple(biases), mask, options.structure, tiling)
        return (out, lse) if options.return_residual else out


class _Tiling(NamedTuple):
    """The static shape of one call: what every function below needs besides the arrays."""

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


# ------------------------------------------------------------------------------------------------
# Chunk sizes
# ------------------------------------------------------------------------------------------------


def tile_bytes(
    batch: int,
    num_heads: int,
    query_chunk: int,
    key_chunk: int,
    head_dim: int,
    value_dim: int,
    dtype: Any,
) -> int:
    """The per-tile working set that `choose_chunk_sizes` keeps under the budget, in bytes.

    For every batch-head (B * N of them), with 4 bytes per float32 (8 for float64 inputs):
      3 * tq * tk * 4            logits/probabilities tiles (s and p; p, dp and ds in the backward,
                                 whose batch-summed bias gradient tile is no larger than ds),
      tq * (H + 2 * Hv + 2) * 4  query-chunk accumulators: dq, the output and dO rows, max and sum,
      tk * (2 * H + 2 * Hv) * 4  key-chunk accumulators dk, dv and the k, v tiles,
      tq * (H + Hv) * itemsize   the q and dO tiles.
    The first line dominates. It is an upper estimate: at B=1024, N=4, tiles 32x32 (193 MiB here)
    XLA reported under 100 MiB of temporaries besides the saved output.

    Args:
      batch: B.
      num_heads: N.
      query_chunk: tq.
      key_chunk: tk.
      head_dim: H.
      value_dim: Hv.
      dtype: the inputs' dtype.

    Returns:
      The estimate in bytes.
    """
    acc = jnp.dtype(accumulation_dtype(dtype)).itemsize
    item = jnp.dtype(dtype).itemsize
    per_head = (
        _TILE_BUFFERS * query_chunk * key_chunk * acc
        + query_chunk * (head_dim + 2 * value_dim + 2) * acc
        + key_chunk * (2 * head_dim + 2 * value_dim) * acc
        + query_chunk * (head_dim + value_dim) * item
    )
    return batch * num_heads * per_head


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

    The working set is `tile_bytes` (float32 logits tiles for all B * N plus accumulators and
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
      memory_budget_bytes: budget for `tile_bytes`.

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
                tile_bytes(batch, num_heads, tq, tk, head_dim, value_dim, dtype)
                > memory_budget_bytes
            ):
                continue
            padded = math.ceil(q_len / tq) * tq * math.ceil(kv_len / tk) * tk
            useful_area = tq * tk * (q_len * kv_len / padded)
            key = (useful_area, -padded, -abs(math.log2(tq / tk)), tk)
            if best_key is None or key > best_key:
                best, best_key = (tq, tk), key
    return best


# ------------------------------------------------------------------------------------------------
# Tiles
# ------------------------------------------------------------------------------------------------
#
# Head-major arrays of a block: the query side ([r, N, T, ...], or [r, K, G, T, ...] with
# grouped-query attention, base.Groups) has its positions on axis -2 of the bias/mask tiles and on
# axis `q.ndim - 2` of q; the key side [r, K, S, ...] on axis 2.


def _slice(x: jax.Array, start, size: int, axis: int) -> jax.Array:
    """x[..., start:start + size, ...] along `axis`; a no-op when the axis is broadcast (size 1)."""
    if x.shape[axis] == 1 or x.shape[axis] == size:
        return x
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis, allow_negative_indices=False)


def _tile(x: jax.Array | None, i, j, tq: int, tk: int) -> jax.Array | None:
    """The [.., tq or 1, tk or 1] tile (i, j) of a bias or mask."""
    if x is None:
        return None
    return _slice(_slice(x, i * tq, tq, x.ndim - 2), j * tk, tk, x.ndim - 1)


def _add_tile(acc: jax.Array, tile: jax.Array, i, j, tq: int, tk: int) -> jax.Array:
    """acc with `tile` added at tile position (i, j) (axes of size 1 are not offset)."""
    if tile.shape == acc.shape:
        return acc + tile
    start = [0] * acc.ndim
    start[-2] = 0 if acc.shape[-2] == 1 else i * tq
    start[-1] = 0 if acc.shape[-1] == 1 else j * tk
    start = [jnp.asarray(x, jnp.int32) for x in start]  # one index type (x64 or not)
    old = jax.lax.dynamic_slice(acc, start, tile.shape, allow_negative_indices=False)
    return jax.lax.dynamic_update_slice(acc, old + tile, start, allow_negative_indices=False)


def _loop(lo, hi, body: Callable, init):
    """fori_loop over range(lo, hi): nothing or a direct call for zero or one static step;
    bounds may be traced (a while loop then)."""
    if isinstance(lo, int) and isinstance(hi, int):
        if hi - lo <= 1:
            return init if hi <= lo else body(lo, init)
        return jax.lax.fori_loop(lo, hi, body, init)
    return jax.lax.fori_loop(jnp.int32(lo), jnp.int32(hi), body, init)


def _static(*xs) -> bool:
    return all(isinstance(x, int) for x in xs)


class _Runs(NamedTuple):
    """The tiles of one axis a tile of the other axis meets: [first, stop), of which
    [full_lo, full_hi) the structured masks keep whole (no mask to build there) and the rest
    only in part. Tiles outside [first, stop) are masked whole and skipped."""

    first: Any
    full_lo: Any
    full_hi: Any
    stop: Any

    @classmethod
    def make(cls, reach, full, size: int, length: int, count: int) -> _Runs:
        """From the positions some ([lo, hi) = reach) and all (full) of the tile may attend."""
        (lo, hi), (full_lo, full_hi) = reach, full
        if _static(lo, hi, full_lo, full_hi):
            first, stop = (lo // size, -(-hi // size)) if hi > lo else (0, 0)
            a = min(max(-(-full_lo // size), first), stop)
            b = min(max(count if full_hi >= length else full_hi // size, a), stop)
            return cls(first, a, b, stop) if full_hi > full_lo else cls(first, stop, stop, stop)
        first = jnp.minimum(lo // size, count)
        stop = jnp.where(hi > lo, -(-hi // size), first)
        a = jnp.clip(-(-full_lo // size), first, stop)
        b = jnp.clip(jnp.where(full_hi >= length, count, full_hi // size), a, stop)
        empty = full_hi <= full_lo
        return cls(first, jnp.where(empty, stop, a), jnp.where(empty, stop, b), stop)

    def loop(self, body: Callable, init):
        """body(j, state, structured) over the tiles: unmasked ones, then the partly masked."""
        state = _loop(self.full_lo, self.full_hi, lambda j, s: body(j, s, False), init)
        left = self.full_lo - self.first
        count = left + (self.stop - self.full_hi)

        def index(n):  # the n-th partly masked tile
            if _static(n, left):
                return self.first + n if n < left else self.full_hi + n - left
            return jnp.where(n < left, self.first + n, self.full_hi + n - left)

        return _loop(0, count, lambda n, s: body(index(n), s, True), state)


class _Tile(NamedTuple):
    """Logits of one tile, with what the backward needs."""

    s: jax.Array  # [.., tq, tk] masked logits, accumulation dtype
    keep: jax.Array | None  # bool where the explicit or structured mask keeps (None: all)
    cap_grad: jax.Array | None  # d(soft cap)/d(logits) (None: no cap)


def _logits(q_i, k_j, bias, mask, structure, i, j, t: _Tiling, groups, structured=True) -> _Tile:
    """Scaled, biased, capped, masked logits of tile (i, j), [.., tq, tk] (accumulation dtype);
    structured=False: a tile the structured masks keep whole (_Runs)."""
    acc = accumulation_dtype(q_i.dtype)
    if q_i.dtype == acc:
        # Scaling the query tile rather than the logits: the same value up to float32 rounding,
        # and the multiply no longer sits between the dot and the softmax.
        q_i = q_i * jnp.asarray(t.scale, acc)
        s = jnp.einsum(groups.qk, q_i, k_j, preferred_element_type=acc, precision=t.precision)
    else:
        s = jnp.einsum(groups.qk, q_i, k_j, preferred_element_type=acc, precision=t.precision)
        s = s * jnp.asarray(t.scale, acc)  # [.., tq, tk]
    for b in bias:  # a tuple: several biases are added tile by tile, never summed whole
        s = s + _tile(b, i, j, t.tq, t.tk).astype(acc)
    cap_grad = None
    if t.soft_cap is not None:
        s = numerics.soft_cap(s, t.soft_cap)
        cap_grad = 1 - jnp.square(s / jnp.asarray(t.soft_cap, acc))
    keep = _tile(mask, i, j, t.tq, t.tk)
    s = numerics.mask_logits(s, keep)
    block = structure.block(i * t.tq, t.tq, j * t.tk, t.tk) if structured else None
    if block is not None:  # [r|1, 1, tq|1, tk|1]
        block = block if groups.size == 1 else block[:, :, None]
        s = jnp.where(block, s, jnp.asarray(MASK_VALUE, acc))
        keep = block if keep is None else keep & block
    if t.kv_len % t.tk:  # the last key tile is padded
        shape = (1,) * (s.ndim - 1) + (t.tk,)
        key_pos = j * t.tk + jax.lax.broadcasted_iota(jnp.int32, shape, s.ndim - 1)
        s = jnp.where(key_pos < t.kv_len, s, jnp.asarray(_PAD_VALUE, acc))
    return _Tile(s, keep, cap_grad)


def _skips(structure) -> bool:
    """Whether the structure can mask whole tiles (else every tile runs, unmasked by it)."""
    return structure.is_causal or structure.window is not None or structure.has_lengths


def _key_runs(structure, i, t: _Tiling) -> _Runs:
    """The key tiles query tile i meets (_Runs)."""
    n_k = t.kv_pad // t.tk
    if not _skips(structure):
        return _Runs(0, 0, n_k, n_k)
    start, stop = i * t.tq, masking.min_(i * t.tq + t.tq, t.q_len)
    reach = structure.key_range(start, stop, t.kv_len)
    full = structure.key_range(start, stop, t.kv_len, every=True)
    return _Runs.make(reach, full, t.tk, t.kv_len, n_k)


def _query_runs(structure, j, t: _Tiling) -> _Runs:
    """The query tiles key tile j meets (_Runs)."""
    n_q = t.q_pad // t.tq
    if not _skips(structure):
        return _Runs(0, 0, n_q, n_q)
    start, stop = j * t.tk, masking.min_(j * t.tk + t.tk, t.kv_len)
    reach = structure.query_range(start, stop, t.q_len)
    full = structure.query_range(start, stop, t.q_len, every=True)
    return _Runs.make(reach, full, t.tq, t.q_len, n_q)


# ------------------------------------------------------------------------------------------------
# Forward and backward on padded inputs (T % tq == 0, S % tk == 0)
# ------------------------------------------------------------------------------------------------


def _row_bounds(q_i, key_norm, bias_rows, t: _Tiling) -> jax.Array:
    """An upper bound on every logit of each query row of a block, [.., tq] (accumulation dtype).

    |scale * q.k| <= scale * |q| * max_j |k_j| (Cauchy-Schwarz; key_norm [B, K] is that maximum,
    padded keys are zero vectors), and each bias adds at most its row maximum (bias_rows: the
    block's rows of each bias); the soft cap is monotone; the masks only lower logits.
    """
    acc = accumulation_dtype(q_i.dtype)
    query_norm = jnp.sqrt(jnp.sum(jnp.square(q_i.astype(acc)), axis=-1))  # [.., tq]
    key_norm = key_norm.reshape(key_norm.shape + (1,) * (query_norm.ndim - 2))
    bound = query_norm * (jnp.asarray(t.scale, acc) * key_norm)
    for b in bias_rows:
        bound = bound + jnp.max(b, axis=-1).astype(acc)  # [.., tq|1]
    return numerics.soft_cap(bound, t.soft_cap)


@jax.custom_batching.custom_vmap
def _all_mapped(x: jax.Array) -> jax.Array:
    """jnp.all(x), reduced over vmapped axes as well: a lax.cond on it stays a cond under vmap
    (both branches are then batched), where a batched predicate would make vmap run both."""
    return jnp.all(x)


@_all_mapped.def_vmap
def _all_mapped_vmap(axis_size, in_batched, x):
    del axis_size, in_batched
    return _all_mapped(x), False


def _forward(q, k, v, bias, mask, structure, has_key, uniform, t: _Tiling, groups):
    """Output [.., T, Hv] (query dtype), the rows' softmax shifts m and sums of exp(s - m)
    ([.., T], accumulation dtype): m + log(sum) is each row's logsumexp. Padded, head-major
    inputs (query side grouped); masked positions already zeroed. has_key: None (every row has a
    key) or bool [.., T] (padded rows True); uniform: None or [r, K, (1,) 1, Hv], the output of
    rows with no key to attend to.

    Each block of query rows first runs with a fixed shift per row, an upper bound on its logits
    (_row_bounds): no running maximum, no rescaling of the sum and the output after every key
    tile. scripts/benchmark.py shows the effect at the long shape. A bound far above a row's
    largest logit would push exp(s - m) towards underflow; a block in which some row's sum falls
    below kv_len * sqrt(tiny) (so its largest term may be below sqrt(tiny)) is recomputed with the
    running maximum (FlashAttention's online softmax) instead. Under vmap a block is recomputed
    for every mapped element when one of them needs it (_all_mapped), so the cond stays a cond.
    Key tiles the structured masks hide from a whole query tile are skipped, and those they keep
    whole build no mask (_key_runs).
    """
    acc = accumulation_dtype(q.dtype)
    axis = q.ndim - 2  # the query positions
    q_len, tq, tk, kv_len = q.shape[axis], t.tq, t.tk, t.kv_len
    rows_shape = q.shape[:axis] + (tq,)  # [r, K, (G,) tq]
    n_q = q_len // tq
    tile_logits = functools.partial(_logits, structure=structure, t=t, groups=groups)
    key_norm = jnp.sqrt(jnp.max(jnp.sum(jnp.square(k.astype(acc)), axis=-1), axis=-1))  # [r, K]
    min_sum = jnp.asarray(kv_len * float(np.sqrt(jnp.finfo(acc).tiny)), acc)

    def zeros():
        return jnp.zeros(rows_shape, acc), jnp.zeros((*rows_shape, v.shape[-1]), acc)

    def pv(p, v_j):
        return jnp.einsum(
            groups.pv, p.astype(v.dtype), v_j, preferred_element_type=acc, precision=t.precision
        )  # [.., tq, Hv]

    def bounded(i, runs):  # fixed shift per row: the bound
        q_i = _slice(q, i * tq, tq, axis)  # [.., tq, H]
        bias_rows = [_slice(b, i * tq, tq, b.ndim - 2) for b in bias]
        m = _row_bounds(q_i, key_norm, bias_rows, t)  # [.., tq]

        def step(j, state, structured):
            row_sum, o = state
            k_j, v_j = _slice(k, j * tk, tk, 2), _slice(v, j * tk, tk, 2)
            s = tile_logits(q_i, k_j, bias, mask, i=i, j=j, structured=structured).s
            p = jnp.exp(s - m[..., None])  # [.., tq, tk]
            return row_sum + jnp.sum(p, axis=-1), o + pv(p, v_j)

        return (m, *runs.loop(step, zeros()))

    def online(i, runs):  # running maximum, FlashAttention-2
        q_i = _slice(q, i * tq, tq, axis)  # sliced here, not passed in: no copy for the cond

        def step(j, state, structured):
            m, row_sum, o = state
            k_j, v_j = _slice(k, j * tk, tk, 2), _slice(v, j * tk, tk, 2)
            s = tile_logits(q_i, k_j, bias, mask, i=i, j=j, structured=structured).s
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            correction = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[..., None])
            row_sum = row_sum * correction + jnp.sum(p, axis=-1)
            return m_new, row_sum, o * correction[..., None] + pv(p, v_j)

        return runs.loop(step, (jnp.full(rows_shape, -jnp.inf, acc), *zeros()))

    def rows(i, carry):
        runs = _key_runs(structure, i, t)
        m, row_sum, o = bounded(i, runs)
        fine = row_sum >= min_sum  # False for NaN too
        if has_key is not None:
            has_key_i = _slice(has_key, i * tq, tq, has_key.ndim - 1)  # [.., tq]
            fine = fine | ~has_key_i
        m, row_sum, o = jax.lax.cond(
            _all_mapped(fine), lambda: (m, row_sum, o), lambda: online(i, runs)
        )
        o = o / row_sum[..., None]
        if has_key is not None:
            o = jnp.where(has_key_i[..., None], o, uniform)
            m = jnp.where(has_key_i, m, jnp.asarray(MASK_VALUE, acc))
            row_sum = jnp.where(has_key_i, row_sum, jnp.asarray(kv_len, acc))
        o = o.astype(q.dtype)
        if n_q == 1:
            return o, m, row_sum
        out, m_all, sum_all = carry
        out = _put(out, o, i * tq, axis)
        m_all = _put(m_all, m, i * tq, axis)
        sum_all = _put(sum_all, row_sum, i * tq, axis)
        return out, m_all, sum_all

    if n_q == 1:
        return rows(0, None)
    init = (
        jnp.zeros((*q.shape[:-1], v.shape[-1]), q.dtype),
        jnp.zeros(q.shape[:-1], acc),
        jnp.zeros(q.shape[:-1], acc),
    )
    return jax.lax.fori_loop(0, n_q, rows, init)


def _reduce_to(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Sums a [.., tq, tk] tile over the axes where `shape` (a bias's shape) has size 1."""
    axes = tuple(a for a, d in enumerate(shape) if d == 1 and x.shape[a] != 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def _backward(q, k, v, bias, mask, structure, out, m, row_sum, cotangents, t: _Tiling, groups):
    """Gradients (dq, dk, dv, dbias) of a padded head-major block, recomputing p tile by tile;
    dbias in the accumulation dtype. cotangents: (g, g_lse) of the output and the logsumexp,
    zero in rows with no key to attend to. Query tiles the structured masks hide from a whole
    key tile are skipped (_query_runs)."""
    g, g_lse = cotangents
    acc = accumulation_dtype(q.dtype)
    axis = q.ndim - 2
    tq, tk, scale = t.tq, t.tk, t.scale
    n_q, n_k = q.shape[axis] // tq, k.shape[2] // tk
    tile_logits = functools.partial(_logits, structure=structure, t=t, groups=groups)
    dot = functools.partial(jnp.einsum, preferred_element_type=acc, precision=t.precision)
    # d lse / d logits = p, so the logsumexp's cotangent joins delta: ds = p * (dp - delta + g_lse).
    delta = jnp.sum(g.astype(acc) * out.astype(acc), axis=-1) - g_lse  # [.., T]
    log_sum = jnp.log(row_sum)  # [.., T]
    g = g.astype(v.dtype)

    def key_block(j, carry):
        dq, dk, dv, dbias = carry
        k_j, v_j = _slice(k, j * tk, tk, 2), _slice(v, j * tk, tk, 2)  # [r, K, tk, H], [.., Hv]

        def row_block(i, state, structured):
            dq, dbias, dk_j, dv_j = state
            q_i, g_i = _slice(q, i * tq, tq, axis), _slice(g, i * tq, tq, axis)
            m_i, log_sum_i = _slice(m, i * tq, tq, axis), _slice(log_sum, i * tq, tq, axis)
            delta_i = _slice(delta, i * tq, tq, axis)  # [.., tq]
            tile = tile_logits(q_i, k_j, bias, mask, i=i, j=j, structured=structured)
            # exp((s - m) - log_sum) rather than exp(s - lse): in a fully masked row (every logit
            # -1e9) lse = m + log(S) rounds to m in float32, which would give p = 1 instead of 1/S.
            p = jnp.exp((tile.s - m_i[..., None]) - log_sum_i[..., None])
            dv_j = dv_j + dot(groups.kv, p.astype(v.dtype), g_i)  # [r, K, tk, Hv]
            dp = dot(groups.qk, g_i, v_j)  # [.., tq, tk]
            ds = p * (dp - delta_i[..., None])
            if tile.cap_grad is not None:
                ds = ds * tile.cap_grad
            if tile.keep is not None:
                ds = jnp.where(tile.keep, ds, jnp.zeros((), acc))
            dbias = tuple(
                _add_tile(db, _reduce_to(ds, b.shape), i, j, tq, tk)
                for db, b in zip(dbias, bias, strict=True)
            )
            dq_i = dot(groups.pv, ds.astype(k.dtype), k_j)  # [.., tq, H]
            dq = dq + dq_i if n_q == 1 else _add_rows(dq, dq_i, i * tq, axis)
            dk_j = dk_j + dot(groups.kv, ds.astype(q.dtype), q_i)  # [r, K, tk, H]
            return dq, dbias, dk_j, dv_j

        init = (dq, dbias, jnp.zeros(k_j.shape, acc), jnp.zeros(v_j.shape, acc))
        dq, dbias, dk_j, dv_j = _query_runs(structure, j, t).loop(row_block, init)
        dk_j = (dk_j * jnp.asarray(scale, acc)).astype(k.dtype)
        dv_j = dv_j.astype(v.dtype)
        if n_k == 1:
            return dq, dk_j, dv_j, dbias
        dk = _put(dk, dk_j, j * tk, 2)
        dv = _put(dv, dv_j, j * tk, 2)
        return dq, dk, dv, dbias

    init = (
        jnp.zeros(q.shape, acc),
        None if n_k == 1 else jnp.zeros(k.shape, k.dtype),
        None if n_k == 1 else jnp.zeros(v.shape, v.dtype),
        tuple(jnp.zeros(b.shape, acc) for b in bias),
    )
    dq, dk, dv, dbias = _loop(0, n_k, key_block, init)
    dq = (dq * jnp.asarray(scale, acc)).astype(q.dtype)
    return dq, dk, dv, dbias


def _put(x: jax.Array, update: jax.Array, start, axis: int) -> jax.Array:
    """x with x[.., start:start + len(update), ..] (along `axis`) replaced by `update`."""
    return jax.lax.dynamic_update_slice_in_dim(
        x, update, start, axis=axis, allow_negative_indices=False
    )


def _add_rows(x: jax.Array, rows: jax.Array, start, axis: int) -> jax.Array:
    """x with `rows` added at x[.., start:start + len(rows), ..] along `axis`."""
    return _put(x, _slice(x, start, rows.shape[axis], axis) + rows, start, axis)


# ------------------------------------------------------------------------------------------------
# Blocks of batch rows: layout change, zeroing and padding per block, under one custom_vjp
# ------------------------------------------------------------------------------------------------


def _pad_axis(x: jax.Array | None, axis: int, length: int, padded: int, value) -> jax.Array | None:
    """Pads `axis` of x from `length` to `padded` with `value` unless that axis is broadcast."""
    if x is None or x.shape[axis] != length or padded == length:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, padded - length)
    return jnp.pad(x, widths, constant_values=value)


def _pad_pair(x: jax.Array | None, t: _Tiling, value) -> jax.Array | None:
    """A bias or mask [., ., T|1, S|1] padded to [., ., q_pad|1, kv_pad|1]."""
    return _pad_axis(_pad_axis(x, 2, t.q_len, t.q_pad, value), 3, t.kv_len, t.kv_pad, value)


class _Blocks:
    """Block i of the call's inputs: rows [i * rows, (i + 1) * rows) of every batched array.

    A bias or mask whose batch dimension is 1 is shared by every block and padded once.
    """

    def __init__(self, query, key, biases, mask, structure, t: _Tiling):
        self.t = t
        self.groups = base.Groups.of(query, key)
        self.batch = query.shape[0]
        self.count = self.batch // t.rows
        self.biases, self.mask, self.structure = biases, mask, structure
        self.padded_biases = tuple(b if self.batched(b) else _pad_pair(b, t, 0) for b in biases)
        self.padded_mask = mask if self.batched(mask) else _pad_pair(mask, t, True)

    def batched(self, x) -> bool:
        return x is not None and x.shape[0] != 1

    def rows(self, x, i):
        """x's rows of block i (x itself when it is shared or there is one block)."""
        if x is None or self.count == 1 or not self.batched(x):
            return x
        return jax.lax.dynamic_slice_in_dim(x, i * self.t.rows, self.t.rows, axis=0)

    def head_major(self, x, i):
        """[B, L, N, H] -> block i, [rows, N, L, H] in the compute dtype."""
        return jnp.swapaxes(self.rows(x, i), 1, 2).astype(self.t.compute_dtype)

    def pair(self, i):
        """Block i's biases and mask, padded, query side grouped."""
        t = self.t
        biases = tuple(
            _pad_pair(self.rows(b, i), t, 0) if self.batched(b) else p
            for b, p in zip(self.biases, self.padded_biases, strict=True)
        )
        mask = self.padded_mask
        if self.batched(self.mask):
            mask = _pad_pair(self.rows(self.mask, i), t, True)
        return tuple(self.groups.split(b) for b in biases), self.groups.split(mask)

    def inputs(self, query, key, value, i):
        """Block i's head-major q (grouped), k, v with dead positions zeroed and padded, the
        value as given (for the uniform rows), the structure of its rows and its live queries
        and keys (masking.Structure.live, unpadded)."""
        t = self.t
        structure = self.structure.rows(lambda x: self.rows(x, i))
        live = structure.live(self.rows(self.mask, i), t.q_len, t.kv_len)
        q, k, v = (self.head_major(x, i) for x in (query, key, value))
        raw_v = v
        q, k, v = numerics.zero_dead_inputs(q, k, v, *live, head_major=True)
        q = self.groups.split(_pad_axis(q, 2, t.q_len, t.q_pad, 0))
        k, v = (_pad_axis(x, 2, t.kv_len, t.kv_pad, 0) for x in (k, v))
        return q, k, v, raw_v, structure, live

    def loop(self, step, init):
        """carry = step(i, start, carry) for every block i (its rows from `start`): the row
        loop (mapping.rows)."""
        rows = self.t.rows
        return mapping.rows(
            self.batch, rows, lambda start, n, c: step(start // rows, start, c), init
        )


def _put_rows(buffers, pieces, start):
    """Each piece written into its buffer at `start` along the batch (the first axis)."""
    return tuple(
        jax.lax.dynamic_update_slice_in_dim(b, p.astype(b.dtype), start, 0)
        for b, p in zip(buffers, pieces, strict=True)
    )


def _blocks_forward(query, key, value, biases, mask, structure, t: _Tiling):
    """out [B, T, N, Hv] in query's dtype; m, row_sum [B, N, T] in the accumulation dtype."""
    blocks = _Blocks(query, key, biases, mask, structure, t)
    groups = blocks.groups
    acc = accumulation_dtype(t.compute_dtype)

    def block(i):
        q, k, v, raw_v, structure, (live_q, _) = blocks.inputs(query, key, value, i)
        uniform = has_key = None
        if live_q is not None:
            uniform = jnp.mean(raw_v.astype(acc), axis=2, keepdims=True)  # [rows, K, 1, Hv]
            uniform = uniform if groups.size == 1 else uniform[:, :, None]
            has_key = groups.split(_pad_axis(live_q, 2, t.q_len, t.q_pad, True))
        out, m, row_sum = _forward(q, k, v, *blocks.pair(i), structure, has_key, uniform, t, groups)
        out, m, row_sum = (groups.merge(x)[:, :, : t.q_len] for x in (out, m, row_sum))
        return jnp.swapaxes(out, 1, 2).astype(query.dtype), m, row_sum  # [rows, T, N, Hv]

    if blocks.count == 1:
        return block(0)
    stats = jnp.zeros((blocks.batch, query.shape[2], t.q_len), acc)  # [B, N, T]
    init = (jnp.zeros((*query.shape[:3], value.shape[3]), query.dtype), stats, stats)
    return blocks.loop(lambda i, start, outs: _put_rows(outs, block(i), start), init)


def _blocks_backward(res, g, g_lse, t: _Tiling):
    """(dq, dk, dv, dbiases) of the call, block by block (module docstring)."""
    query, key, value, biases, mask, structure, out, m, row_sum = res
    blocks = _Blocks(query, key, biases, mask, structure, t)
    groups = blocks.groups
    acc = accumulation_dtype(t.compute_dtype)
    shared = [i for i, b in enumerate(biases) if not blocks.batched(b)]

    def block(i):
        q, k, v, _, block_structure, (live_q, live_k) = blocks.inputs(query, key, value, i)
        g_i, out_i = (blocks.head_major(x, i) for x in (g, out))  # [rows, N, T, Hv]
        m_i, sum_i = blocks.rows(m, i), blocks.rows(row_sum, i)  # [rows, N, T]
        g_lse_i = blocks.rows(g_lse, i).astype(acc)  # [rows, N, T]
        uniform_grad = None
        if live_q is not None:
            # Rows with no key to attend to are the uniform average of the values as given: their
            # cotangent goes to every value alike, and none into the attention below.
            has_key = live_q[..., None]  # [rows|1, N|1, T, 1]
            dead = jnp.where(has_key, jnp.zeros((), g_i.dtype), g_i)
            uniform_grad = jnp.sum(dead.astype(acc), axis=2, keepdims=True) / t.kv_len
            if groups.size > 1:  # [rows, N, 1, Hv] -> [rows, K, 1, Hv]
                uniform_grad = jnp.sum(groups.split(uniform_grad), axis=2)
            g_i = jnp.where(has_key, g_i, jnp.zeros((), g_i.dtype))
            g_lse_i = jnp.where(live_q, g_lse_i, 0.0)
        g_i, out_i = (_pad_axis(x, 2, t.q_len, t.q_pad, 0) for x in (g_i, out_i))
        m_i, g_lse_i = (_pad_axis(x, 2, t.q_len, t.q_pad, 0) for x in (m_i, g_lse_i))
        sum_i = _pad_axis(sum_i, 2, t.q_len, t.q_pad, 1)
        g_i, out_i, m_i, sum_i, g_lse_i = (
            groups.split(x) for x in (g_i, out_i, m_i, sum_i, g_lse_i)
        )
        biases_i, mask_i = blocks.pair(i)
        dq, dk, dv, dbias = _backward(
            q, k, v, biases_i, mask_i, block_structure, out_i, m_i, sum_i, (g_i, g_lse_i), t,
            groups,
        )  # fmt: skip
        dq = groups.merge(dq)[:, :, : t.q_len]
        dk, dv = dk[:, :, : t.kv_len], dv[:, :, : t.kv_len]
        # Back through zero_dead_inputs: zeroed positions take no gradient.
        dq, dk, dv = numerics.zero_dead_inputs(dq, dk, dv, live_q, live_k, head_major=True)
        if uniform_grad is not None:
            dv = dv + uniform_grad.astype(dv.dtype)
        grads = tuple(
            jnp.swapaxes(d, 1, 2).astype(x.dtype) for d, x in ((dq, query), (dk, key), (dv, value))
        )
        dbias = tuple(
            groups.merge(db)[:, :, : b.shape[2], : b.shape[3]]
            for db, b in zip(dbias, biases, strict=True)
        )
        return grads, dbias

    if blocks.count == 1:
        grads, dbias = block(0)
    else:
        # Per-row results written in place; a bias shared by the batch summed over the blocks.
        rows = lambda x: jnp.zeros(x.shape, x.dtype)
        init = (
            tuple(rows(x) for x in (query, key, value)),
            tuple(jnp.zeros(b.shape, acc) for b in biases),
        )

        def step(i, start, carry):
            grads, dbias = block(i)
            total, parts = carry
            parts = tuple(
                p + d if j in shared else jax.lax.dynamic_update_slice_in_dim(p, d, start, 0)
                for j, (p, d) in enumerate(zip(parts, dbias, strict=True))
            )
            return _put_rows(total, grads, start), parts

        grads, dbias = blocks.loop(step, init)
    dbias = tuple(d.astype(b.dtype) for d, b in zip(dbias, biases, strict=True))
    return (*grads, dbias)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attention(query, key, value, biases, mask, structure, t: _Tiling):
    """(out [B, T, N, Hv], logsumexp [B, N, T]), both with gradients."""
    out, m, row_sum = _blocks_forward(query, key, value, biases, mask, structure, t)
    return out, m + jnp.log(row_sum)


def _attention_fwd(query, key, value, biases, mask, structure, t):
    out, m, row_sum = _blocks_forward(query, key, value, biases, mask, structure, t)
    residuals = (query, key, value, biases, mask, structure, out, m, row_sum)
    return (out, m + jnp.log(row_sum)), residuals


def _attention_bwd(t, res, cotangents):
    g, g_lse = cotangents  # g_lse: zero unless options.residual_gradient
    dq, dk, dv, dbias = _blocks_backward(res, g, g_lse, t)
    return dq, dk, dv, dbias, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)
