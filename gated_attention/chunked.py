"""Memory-efficient attention: online softmax over query and key tiles, with a tiled backward.

Rabe & Staats (2021), "Self-attention does not need O(n^2) memory", in the FlashAttention-2 form:
the forward loops over query chunks (outer) and key chunks (inner), carrying per query row the
sum of exp(logit - m) and the float32 output accumulator; it never holds more than one
[B, N, tq, tk] tile of logits. The shift m is first a fixed upper bound on the row's logits (from
|q| max|k| and the bias's row maximum), which saves the running maximum and the rescaling after
every key tile; a block of rows where that bound is so loose that the sum nears underflow is
recomputed with the running maximum (see _forward). The backward (a `jax.custom_vjp`) saves only
q, k, v, bias, mask, the output and the per-row softmax statistics (m and log-sum, together the
logsumexp), and recomputes the probabilities tile by tile, key chunks outer and query chunks inner:
D = rowsum(dO * O); per tile p = exp(s - lse), dv += p^T dO, dp = dO v^T, ds = p * (dp - D)
(zero where masked), dq += ds k, dk += ds^T q, dbias += ds summed to the bias's own shape.

Layout and numerics are those of xla.py (the specification): head-major query [B, N, T, H],
key [B, N, S, H], value [B, N, S, Hv]; bias and mask of rank 4 whose every dimension is 1 or equal
to [B, N, T, S]; logits accumulate in float32 (float64 for float64 inputs); masked keys get zero
weight and a fully masked row is the uniform average of the values. As in xla.py, the forward adds
-1e9 to masked logits (a fused add, not a select) and sets fully masked rows, and their softmax
statistics, to what replacing every logit by -1e9 gives; the backward recomputes with replacement.
The two agree wherever the largest unmasked logit of a row is far above -1e9 (it differs only for
rows whose every unmasked logit has a bias near -1e9 itself). For float32/float64 inputs the scale
multiplies the query tile before the dot rather than the logits after it (see _logits).

Einsum letters: b batch, n heads, q query positions, k key positions, h per-head channel.

Chunk sizes that do not divide the lengths are handled by padding: padded keys get the logit -1e30,
far below the mask value, so they never take weight even in a fully masked row; padded query rows
are sliced off. Lengths that the chunk sizes divide are never copied.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gated_attention.xla import MASK_VALUE, accumulation_dtype, mask_bias

# Logit of padded keys: exp(_PAD_VALUE - MASK_VALUE) == 0, so padding never takes weight.
_PAD_VALUE = -1e30

# Working-set budget (tile_bytes) used to choose chunk sizes when none are given. Measured on the
# 2-core CPU (jax 0.10.2, float32 forward, jit, median of 5 interleaved rounds, ratios to a dense
# head-major einsum in the same run; ratios move +-0.15 between runs on this shared machine):
#   B=1, N=8, T=S=4096, H=32: 64x512 (0.62-0.75) and 1024x1024 (0.72-0.77) were consistently
#     slower than tiles from 128x512 to 512x1024. The budget is not the limit here (512x512 needs
#     29 MiB); the per-head cap _MAX_TILE_ELEMENTS is (see there).
#   B=64, N=8, T=S=256, H=8: splitting keys costs (256x128: 0.89-1.19, 128x128: 0.77-1.15), splitting
#     queries hardly does (256x256: 0.62-0.72, 128x256: 0.54-0.67, 64x256: 0.62-0.74). 256 MiB
#     gives 128x256 (the whole problem would need 421 MiB by tile_bytes, which counts the backward).
# 256 MiB is also the budget attention.py uses to decide when to leave the dense implementation.
DEFAULT_MEMORY_BUDGET_BYTES = 256 * 2**20

# Upper bound on tq * tk per (batch, head): 512 KiB of float32 logits, 4 MiB per tile at 8 heads.
# Each forward step holds two tiles (logits, probabilities). With 512 * 512 the long shape
# (B=1, T=S=4096, c=256, 8 heads of 32) ran in 512x512 tiles, and the Attention module's XLA temp
# was 34 MiB: above glibc's largest mmap threshold (32 MiB), so the buffer is mapped and faulted
# in afresh on every call. With 512 * 256 it runs in 256x512 tiles (ties go to the longer key
# chunk, see B=64 above) in 28 MiB. scripts/benchmark.py, forward, ratio to AF2's formulation
# (float32 / bfloat16): 0.262 / 0.235 with 512x512 tiles, 0.220 / 0.214 with 256x512 tiles (both
# runs with steal at 0-3%; see the README).
_MAX_TILE_ELEMENTS = 512 * 256

# Number of float32 [B, N, tq, tk] buffers live at once in the tiled backward (p, dp, ds), which is
# also enough for the forward (logits, probabilities).
_TILE_BUFFERS = 3


def _check_positive_int(name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")


def _check_shapes(query, key, value, bias, mask) -> None:
    """Raises ValueError unless the inputs follow the head-major layout of the module docstring."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have rank 4 (head-major layout), got shape {x.shape}")
    batch, heads, q_len, head_dim = query.shape
    if key.shape[:2] != (batch, heads) or key.shape[3] != head_dim:
        raise ValueError(f"key shape {key.shape} does not match query shape {query.shape}")
    if value.shape[:3] != key.shape[:3]:
        raise ValueError(f"value shape {value.shape} does not match key shape {key.shape}")
    if 0 in query.shape or 0 in value.shape:
        raise ValueError(
            f"query, key and value need non-empty axes, got shapes {query.shape}, {value.shape}"
        )
    full = (batch, heads, q_len, key.shape[2])
    named = [(f"bias[{i}]" if len(bias) > 1 else "bias", b) for i, b in enumerate(bias)]
    for name, x in (*named, ("mask", mask)):
        if x is None:
            continue
        if x.ndim != 4 or any(d not in (1, f) for d, f in zip(x.shape, full, strict=True)):
            raise ValueError(
                f"{name} must have rank 4 with every dimension 1 or equal to {full}, got {x.shape}"
            )
    if mask is not None and mask.dtype != jnp.bool_:
        raise ValueError(f"mask must be a bool array, got dtype {mask.dtype}")


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
        _check_positive_int(name, v)
        if v is None:
            raise ValueError(f"{name} must be a positive int, got None")
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


def _slice(x: jax.Array, start, size: int, axis: int) -> jax.Array:
    """x[..., start:start + size, ...] along `axis`; a no-op when the axis is broadcast (size 1)."""
    if x.shape[axis] == 1 or x.shape[axis] == size:
        return x
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis, allow_negative_indices=False)


def _tile(x: jax.Array | None, i, j, tq: int, tk: int) -> jax.Array | None:
    """The [., ., tq or 1, tk or 1] tile (i, j) of a bias or mask."""
    if x is None:
        return None
    return _slice(_slice(x, i * tq, tq, 2), j * tk, tk, 3)


def _add_tile(acc: jax.Array, tile: jax.Array, i, j, tq: int, tk: int) -> jax.Array:
    """acc with `tile` added at tile position (i, j) (axes of size 1 are not offset)."""
    start_q = 0 if acc.shape[2] == 1 else i * tq
    start_k = 0 if acc.shape[3] == 1 else j * tk
    if tile.shape == acc.shape:
        return acc + tile
    old = jax.lax.dynamic_slice(
        acc, (0, 0, start_q, start_k), tile.shape, allow_negative_indices=False
    )
    return jax.lax.dynamic_update_slice(
        acc, old + tile, (0, 0, start_q, start_k), allow_negative_indices=False
    )


def _loop(n: int, body: Callable, init):
    """fori_loop over range(n), called directly when there is one step (no while loop)."""
    if n == 1:
        return body(0, init)
    return jax.lax.fori_loop(0, n, body, init)


def _logits(q_i, k_j, bias, mask, i, j, *, scale, tq, tk, kv_len, add_mask=False) -> jax.Array:
    """Scaled, biased, masked logits of tile (i, j), [B, N, tq, tk] in the accumulation dtype.

    Masked logits are replaced by MASK_VALUE, or with add_mask (the forward) have MASK_VALUE added:
    the same softmax in every row with a key to attend to, and one fused add instead of a select
    (see xla.dense); _forward sets fully masked rows to what replacement gives.
    """
    acc = accumulation_dtype(q_i.dtype)
    if q_i.dtype == acc:
        # Scaling the query tile rather than the logits: the same value up to float32 rounding,
        # and the multiply no longer sits between the dot and the softmax (1.1-1.7x faster).
        q_i = q_i * jnp.asarray(scale, acc)
        s = jnp.einsum("bnqh,bnkh->bnqk", q_i, k_j, preferred_element_type=acc)  # [B, N, tq, tk]
    else:
        s = jnp.einsum("bnqh,bnkh->bnqk", q_i, k_j, preferred_element_type=acc)  # [B, N, tq, tk]
        s = s * jnp.asarray(scale, acc)
    for b in bias:  # a tuple: several biases are added tile by tile, never summed whole
        s = s + _tile(b, i, j, tq, tk).astype(acc)
    if mask is not None and add_mask:
        s = s + mask_bias(_tile(mask, i, j, tq, tk), acc)
    elif mask is not None:
        s = jnp.where(_tile(mask, i, j, tq, tk), s, jnp.asarray(MASK_VALUE, acc))
    if kv_len % tk:  # the last key tile is padded
        key_pos = j * tk + jax.lax.broadcasted_iota(jnp.int32, (1, 1, 1, tk), 3)
        s = jnp.where(key_pos < kv_len, s, jnp.asarray(_PAD_VALUE, acc))
    return s


# ------------------------------------------------------------------------------------------------
# Forward and backward on padded inputs (T % tq == 0, S % tk == 0)
# ------------------------------------------------------------------------------------------------


def _row_bounds(q_i, key_norm, bias_rows, scale) -> jax.Array:
    """An upper bound on every logit of each query row of a block, [B, N, tq] (accumulation dtype).

    |scale * q.k| <= scale * |q| * max_j |k_j| (Cauchy-Schwarz; key_norm [B, N] is that maximum,
    padded keys are zero vectors), and each bias adds at most its row maximum (bias_rows: the
    block's rows of each bias); the mask only lowers logits.
    """
    acc = accumulation_dtype(q_i.dtype)
    query_norm = jnp.sqrt(jnp.sum(jnp.square(q_i.astype(acc)), axis=-1))  # [B, N, tq]
    bound = query_norm * (jnp.asarray(scale, acc) * key_norm[..., None])
    for b in bias_rows:
        bound = bound + jnp.max(b, axis=-1).astype(acc)  # [B|1, N|1, tq|1]
    return bound


@jax.custom_batching.custom_vmap
def _all_mapped(x: jax.Array) -> jax.Array:
    """jnp.all(x), reduced over vmapped axes as well: a lax.cond on it stays a cond under vmap
    (both branches are then batched), where a batched predicate would make vmap run both."""
    return jnp.all(x)


@_all_mapped.def_vmap
def _all_mapped_vmap(axis_size, in_batched, x):
    del axis_size, in_batched
    return _all_mapped(x), False


def _forward(q, k, v, bias, mask, scale, tq, tk, kv_len):
    """Output [B, N, T, Hv] (query dtype), the rows' softmax shifts m and sums of exp(s - m)
    ([B, N, T], accumulation dtype): m + log(sum) is each row's logsumexp.

    Each block of query rows first runs with a fixed shift per row, an upper bound on its logits
    (_row_bounds): no running maximum, no rescaling of the sum and the output after every key
    tile. scripts/benchmark.py shows the effect at the long shape. A bound far above a row's
    largest logit would push exp(s - m) towards underflow; a block in which some row's sum falls
    below kv_len * sqrt(tiny) (so its largest term may be below sqrt(tiny)) is recomputed with the
    running maximum (FlashAttention's online softmax) instead. Under vmap a block is recomputed
    for every mapped element when one of them needs it (_all_mapped), so the cond stays a cond.
    """
    batch, heads, q_len, _ = q.shape
    acc = accumulation_dtype(q.dtype)
    n_q, n_k = q_len // tq, k.shape[2] // tk
    tile_logits = functools.partial(
        _logits, scale=scale, tq=tq, tk=tk, kv_len=kv_len, add_mask=True
    )
    key_norm = jnp.sqrt(jnp.max(jnp.sum(jnp.square(k.astype(acc)), axis=-1), axis=-1))  # [B, N]
    min_sum = jnp.asarray(kv_len * float(np.sqrt(jnp.finfo(acc).tiny)), acc)

    if mask is not None:
        # Rows with no key to attend to get the uniform average of the (unpadded) values and the
        # statistics replacement gives (every logit MASK_VALUE), which the backward recomputes.
        # Applied per row block: a select over the whole output would copy it.
        has_key = jnp.any(mask[..., :kv_len], axis=-1)  # [B|1, N|1, T|1]
        uniform = jnp.mean(v[:, :, :kv_len].astype(acc), axis=2, keepdims=True)  # [B, N, 1, Hv]

    def zeros():
        return (
            jnp.zeros((batch, heads, tq), acc),
            jnp.zeros((batch, heads, tq, v.shape[3]), acc),
        )

    def bounded(i):  # fixed shift per row: the bound
        q_i = _slice(q, i * tq, tq, 2)  # [B, N, tq, H]
        bias_rows = [_slice(b, i * tq, tq, 2) for b in bias]
        m = _row_bounds(q_i, key_norm, bias_rows, scale)  # [B, N, tq]

        def step(j, state):
            row_sum, o = state
            k_j, v_j = _slice(k, j * tk, tk, 2), _slice(v, j * tk, tk, 2)
            p = jnp.exp(tile_logits(q_i, k_j, bias, mask, i, j) - m[..., None])  # [B, N, tq, tk]
            pv = jnp.einsum(
                "bnqk,bnkh->bnqh", p.astype(v.dtype), v_j, preferred_element_type=acc
            )  # [B, N, tq, Hv]
            return row_sum + jnp.sum(p, axis=-1), o + pv

        return (m, *_loop(n_k, step, zeros()))

    def online(i):  # running maximum, FlashAttention-2
        q_i = _slice(q, i * tq, tq, 2)  # sliced here, not passed in: no copy for the cond

        def step(j, state):
            m, row_sum, o = state
            k_j, v_j = _slice(k, j * tk, tk, 2), _slice(v, j * tk, tk, 2)
            s = tile_logits(q_i, k_j, bias, mask, i, j)  # [B, N, tq, tk]
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            correction = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[..., None])
            row_sum = row_sum * correction + jnp.sum(p, axis=-1)
            pv = jnp.einsum(
                "bnqk,bnkh->bnqh", p.astype(v.dtype), v_j, preferred_element_type=acc
            )  # [B, N, tq, Hv]
            return m_new, row_sum, o * correction[..., None] + pv

        return _loop(n_k, step, (jnp.full((batch, heads, tq), -jnp.inf, acc), *zeros()))

    def rows(i, carry):
        m, row_sum, o = bounded(i)
        fine = row_sum >= min_sum  # False for NaN too
        if mask is not None:
            has_key_i = _slice(has_key, i * tq, tq, 2)  # [B|1, N|1, tq|1]
            fine = fine | ~has_key_i
        m, row_sum, o = jax.lax.cond(_all_mapped(fine), lambda: (m, row_sum, o), lambda: online(i))
        o = o / row_sum[..., None]
        if mask is not None:
            o = jnp.where(has_key_i[..., None], o, uniform)
            m = jnp.where(has_key_i, m, jnp.asarray(MASK_VALUE, acc))
            row_sum = jnp.where(has_key_i, row_sum, jnp.asarray(kv_len, acc))
        o = o.astype(q.dtype)
        if n_q == 1:
            return o, m, row_sum
        out, m_all, sum_all = carry
        out = _put(out, o, i * tq)
        m_all = _put(m_all, m, i * tq)
        sum_all = _put(sum_all, row_sum, i * tq)
        return out, m_all, sum_all

    if n_q == 1:
        return rows(0, None)
    init = (
        jnp.zeros((batch, heads, q_len, v.shape[3]), q.dtype),
        jnp.zeros((batch, heads, q_len), acc),
        jnp.zeros((batch, heads, q_len), acc),
    )
    return jax.lax.fori_loop(0, n_q, rows, init)


def _reduce_to(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Sums a [B, N, tq, tk] tile over the axes where `shape` (a bias's shape) has size 1."""
    axes = tuple(a for a, d in enumerate(shape) if d == 1 and x.shape[a] != 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def _backward(q, k, v, bias, mask, out, m, row_sum, g, scale, tq, tk, kv_len):
    """Gradients (dq, dk, dv, dbias) of the padded problem, recomputing p tile by tile."""
    acc = accumulation_dtype(q.dtype)
    n_q, n_k = q.shape[2] // tq, k.shape[2] // tk
    tile_logits = functools.partial(_logits, scale=scale, tq=tq, tk=tk, kv_len=kv_len)
    delta = jnp.sum(g.astype(acc) * out.astype(acc), axis=-1)  # [B, N, T]
    log_sum = jnp.log(row_sum)  # [B, N, T]
    g = g.astype(v.dtype)

    def key_block(j, carry):
        dq, dk, dv, dbias = carry
        k_j, v_j = _slice(k, j * tk, tk, 2), _slice(v, j * tk, tk, 2)  # [B, N, tk, H], [.., Hv]

        def row_block(i, state):
            dq, dbias, dk_j, dv_j = state
            q_i, g_i = _slice(q, i * tq, tq, 2), _slice(g, i * tq, tq, 2)
            m_i, log_sum_i = _slice(m, i * tq, tq, 2), _slice(log_sum, i * tq, tq, 2)  # [B, N, tq]
            delta_i = _slice(delta, i * tq, tq, 2)
            s = tile_logits(q_i, k_j, bias, mask, i, j)  # [B, N, tq, tk]
            # exp((s - m) - log_sum) rather than exp(s - lse): in a fully masked row (every logit
            # -1e9) lse = m + log(S) rounds to m in float32, which would give p = 1 instead of 1/S.
            p = jnp.exp((s - m_i[..., None]) - log_sum_i[..., None])
            dv_j = dv_j + jnp.einsum(
                "bnqk,bnqh->bnkh", p.astype(v.dtype), g_i, preferred_element_type=acc
            )  # [B, N, tk, Hv]
            dp = jnp.einsum("bnqh,bnkh->bnqk", g_i, v_j, preferred_element_type=acc)  # [B,N,tq,tk]
            ds = p * (dp - delta_i[..., None])
            if mask is not None:
                ds = jnp.where(_tile(mask, i, j, tq, tk), ds, jnp.zeros((), acc))
            dbias = tuple(
                _add_tile(db, _reduce_to(ds, b.shape), i, j, tq, tk)
                for db, b in zip(dbias, bias, strict=True)
            )
            dq_i = jnp.einsum(
                "bnqk,bnkh->bnqh", ds.astype(k.dtype), k_j, preferred_element_type=acc
            )  # [B, N, tq, H]
            dq = dq + dq_i if n_q == 1 else _add_rows(dq, dq_i, i * tq)
            dk_j = dk_j + jnp.einsum(
                "bnqk,bnqh->bnkh", ds.astype(q.dtype), q_i, preferred_element_type=acc
            )  # [B, N, tk, H]
            return dq, dbias, dk_j, dv_j

        init = (
            dq,
            dbias,
            jnp.zeros(k_j.shape, acc),
            jnp.zeros(v_j.shape, acc),
        )
        dq, dbias, dk_j, dv_j = _loop(n_q, row_block, init)
        dk_j = (dk_j * jnp.asarray(scale, acc)).astype(k.dtype)
        dv_j = dv_j.astype(v.dtype)
        if n_k == 1:
            return dq, dk_j, dv_j, dbias
        dk = _put(dk, dk_j, j * tk)
        dv = _put(dv, dv_j, j * tk)
        return dq, dk, dv, dbias

    init = (
        jnp.zeros(q.shape, acc),
        None if n_k == 1 else jnp.zeros(k.shape, k.dtype),
        None if n_k == 1 else jnp.zeros(v.shape, v.dtype),
        tuple(jnp.zeros(b.shape, acc) for b in bias),
    )
    dq, dk, dv, dbias = _loop(n_k, key_block, init)
    dq = (dq * jnp.asarray(scale, acc)).astype(q.dtype)
    dbias = tuple(db.astype(b.dtype) for db, b in zip(dbias, bias, strict=True))
    return dq, dk, dv, dbias


def _put(x: jax.Array, update: jax.Array, start) -> jax.Array:
    """x with x[:, :, start:start + len(update)] replaced by `update`."""
    return jax.lax.dynamic_update_slice_in_dim(
        x, update, start, axis=2, allow_negative_indices=False
    )


def _add_rows(x: jax.Array, rows: jax.Array, start) -> jax.Array:
    """x with `rows` added at x[:, :, start:start + len(rows)]."""
    return _put(x, _slice(x, start, rows.shape[2], 2) + rows, start)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _attention(q, k, v, bias, mask, scale, tq, tk, kv_len):
    return _forward(q, k, v, bias, mask, scale, tq, tk, kv_len)[0]


def _attention_fwd(q, k, v, bias, mask, scale, tq, tk, kv_len):
    out, m, row_sum = _forward(q, k, v, bias, mask, scale, tq, tk, kv_len)
    return out, (q, k, v, bias, mask, out, m, row_sum)


def _attention_bwd(scale, tq, tk, kv_len, residuals, g):
    q, k, v, bias, mask, out, m, row_sum = residuals
    dq, dk, dv, dbias = _backward(q, k, v, bias, mask, out, m, row_sum, g, scale, tq, tk, kv_len)
    return dq, dk, dv, dbias, None


_attention.defvjp(_attention_fwd, _attention_bwd)


# ------------------------------------------------------------------------------------------------
# Public entry point
# ------------------------------------------------------------------------------------------------


def _pad_axis(x: jax.Array | None, axis: int, length: int, padded: int, value) -> jax.Array | None:
    """Pads `axis` of x from `length` to `padded` with `value` unless that axis is broadcast."""
    if x is None or x.shape[axis] != length or padded == length:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, padded - length)
    return jnp.pad(x, widths, constant_values=value)


def chunked_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | tuple[jax.Array, ...] | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float,
    query_chunk_size: int | None = None,
    key_chunk_size: int | None = None,
    memory_budget_bytes: int | None = None,
) -> jax.Array:
    """Softmax attention computed tile by tile, in memory bounded by the tiles (forward and grad).

    Args:
      query: [B, N, T, H].
      key: [B, N, S, H].
      value: [B, N, S, Hv].
      bias: None, or a float array or a tuple of float arrays (added tile by tile, never summed
        whole), each of rank 4 with dims 1 or equal to [B, N, T, S]; a bias with
        size-1 dims is never broadcast to [B, N, T, S], and its gradient is summed over them.
      mask: None or a bool array with the same broadcast rule; False entries are masked out.
      scale: multiplies q.k; a Python float (it is static: it cannot be traced).
      query_chunk_size: query rows per tile (clipped to T); None: from `choose_chunk_sizes`.
        Sizes that do not divide T pad the query (and a bias/mask with a T axis) once.
      key_chunk_size: keys per tile (clipped to S); None: from `choose_chunk_sizes`.
        Sizes that do not divide S pad key, value (and a bias/mask with an S axis) once.
      memory_budget_bytes: budget for `choose_chunk_sizes` when a chunk size is None;
        None: DEFAULT_MEMORY_BUDGET_BYTES. Under vmap the budget applies per mapped element.

    Returns:
      [B, N, T, Hv] in query's dtype.

    Raises:
      ValueError: a chunk size or the budget is not a positive int, or the shapes do not follow
        the layout above.
    """
    _check_positive_int("query_chunk_size", query_chunk_size)
    _check_positive_int("key_chunk_size", key_chunk_size)
    _check_positive_int("memory_budget_bytes", memory_budget_bytes)
    bias = () if bias is None else tuple(bias) if isinstance(bias, (tuple, list)) else (bias,)
    _check_shapes(query, key, value, bias, mask)
    batch, heads, q_len, head_dim = query.shape
    kv_len, value_dim = key.shape[2], value.shape[3]
    if query_chunk_size is None or key_chunk_size is None:
        budget = memory_budget_bytes or DEFAULT_MEMORY_BUDGET_BYTES
        auto_q, auto_k = choose_chunk_sizes(
            batch, heads, q_len, kv_len, head_dim, value_dim, query.dtype, budget
        )
        query_chunk_size = query_chunk_size or auto_q
        key_chunk_size = key_chunk_size or auto_k
    tq, tk = min(int(query_chunk_size), q_len), min(int(key_chunk_size), kv_len)
    q_pad, kv_pad = -(-q_len // tq) * tq, -(-kv_len // tk) * tk

    query = _pad_axis(query, 2, q_len, q_pad, 0)
    key = _pad_axis(key, 2, kv_len, kv_pad, 0)
    value = _pad_axis(value, 2, kv_len, kv_pad, 0)
    bias = tuple(_pad_axis(_pad_axis(b, 2, q_len, q_pad, 0), 3, kv_len, kv_pad, 0) for b in bias)
    mask = _pad_axis(_pad_axis(mask, 2, q_len, q_pad, True), 3, kv_len, kv_pad, True)
    out = _attention(query, key, value, bias, mask, float(scale), tq, tk, kv_len)
    return out if q_pad == q_len else out[:, :, :q_len]
