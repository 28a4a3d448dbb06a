"""One block of batch rows of the chunked implementation (attention/xla_chunked/implementation.py), head-major and padded:
the online softmax over query x key tiles (forward) and the tiled backward, with the tile pieces
they share: slices of a tile, the skipped and unmasked tile runs of the structured masks
(masking.py's rule), the logits of a tile and each row's bound on them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gated_attention.attention.xla_chunked.plan import Tiling
from gated_attention.core import masking, numerics
from gated_attention.core.numerics import MASK_VALUE, accumulation_dtype

# Logit of padded keys: exp(_PAD_VALUE - MASK_VALUE) == 0, so padding never takes weight.
_PAD_VALUE = -1e30

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


def _logits(q_i, k_j, bias, mask, structure, i, j, t: Tiling, groups, structured=True) -> _Tile:
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


def _key_runs(structure, i, t: Tiling) -> _Runs:
    """The key tiles query tile i meets (_Runs)."""
    return _runs(structure.key_range, i, (t.tq, t.q_len), (t.tk, t.kv_len), _skips(structure))


def _query_runs(structure, j, t: Tiling) -> _Runs:
    """The query tiles key tile j meets (_Runs)."""
    return _runs(structure.query_range, j, (t.tk, t.kv_len), (t.tq, t.q_len), _skips(structure))


def _runs(span, index, source: tuple[int, int], target: tuple[int, int], skips: bool) -> _Runs:
    """The tiles of the target axis that tile `index` of the source axis meets, from span (the
    structure's key_range or query_range): (tile, length) of each axis."""
    (size, length), (target_size, target_length) = source, target
    count = -(-target_length // target_size)
    if not skips:
        return _Runs(0, 0, count, count)
    start, stop = index * size, masking.min_(index * size + size, length)
    reach = span(start, stop, target_length)
    full = span(start, stop, target_length, every=True)
    return _Runs.make(reach, full, target_size, target_length, count)


# ------------------------------------------------------------------------------------------------
# Forward and backward on padded inputs (T % tq == 0, S % tk == 0)
# ------------------------------------------------------------------------------------------------


def _row_bounds(q_i, key_norm, bias_rows, t: Tiling) -> jax.Array:
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


def forward(q, k, v, bias, mask, structure, has_key, t: Tiling, groups):
    """Output [.., T, Hv] (query dtype), the rows' softmax shifts m and sums of exp(s - m)
    ([.., T], accumulation dtype): m + log(sum) is each row's logsumexp. Padded, head-major
    inputs (query side grouped); masked positions already zeroed. has_key: None (every row has a
    key) or bool [.., T] (padded rows True): a row without one keeps the statistics of a uniform
    row (m MASK_VALUE, sum S: finite in the backward pass) and the output 0, which the caller
    replaces (numerics.finish_rows_without_key).

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
        if has_key is not None:
            o = jnp.where(has_key_i[..., None], o, jnp.zeros((), acc))
            m = jnp.where(has_key_i, m, jnp.asarray(MASK_VALUE, acc))
            row_sum = jnp.where(has_key_i, row_sum, jnp.asarray(kv_len, acc))
        o = (o / row_sum[..., None]).astype(q.dtype)
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


def backward(q, k, v, bias, mask, structure, out, m, row_sum, cotangents, t: Tiling, groups):
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
