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

The causal, window and length masks (masking.StructuredMask) are built per tile from iotas, and only
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

import jax
import jax.numpy as jnp

from gated_attention.attention import base
from gated_attention.attention.xla_chunked import kernels as chunked_tiles
from gated_attention.attention.xla_chunked import plan as chunked_plan
from gated_attention.attention.xla_chunked.plan import DEFAULT_MEMORY_BUDGET_BYTES, Tiling
from gated_attention.core import checks, numerics
from gated_attention.core.numerics import accumulation_dtype
from gated_attention.parallel import row_loop as mapping


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
        """(rows per block, query chunk, key chunk) for [batch, q_len, heads, head_dim] queries
        (chunked_plan.tiling)."""
        return chunked_plan.tiling(
            batch, heads, q_len, kv_len, head_dim, value_dim, dtype,
            query_chunk_size=self.query_chunk_size,
            key_chunk_size=self.key_chunk_size,
            memory_budget_bytes=self.memory_budget_bytes,
            block_bytes=self.block_bytes,
        )  # fmt: skip

    def __call__(
        self,
        query,
        key,
        value,
        biases,
        mask,
        *,
        scale,
        compute_dtype,
        options=base.PLAIN,
        plan=None,
    ):
        del plan  # nothing planned
        batch, q_len, heads, head_dim = query.shape
        kv_len, value_dim = key.shape[1], value.shape[-1]
        rows, tq, tk = self.tiling(batch, heads, q_len, kv_len, head_dim, value_dim, compute_dtype)
        tiling = Tiling(
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


def _pad_pair(x: jax.Array | None, t: Tiling, value) -> jax.Array | None:
    """A bias or mask [., ., T|1, S|1] padded to [., ., q_pad|1, kv_pad|1]."""
    return _pad_axis(_pad_axis(x, 2, t.q_len, t.q_pad, value), 3, t.kv_len, t.kv_pad, value)


class _Blocks:
    """Block i of the call's inputs: rows [i * rows, (i + 1) * rows) of every batched array.

    A bias or mask whose batch dimension is 1 is shared by every block and padded once.
    """

    def __init__(self, query, key, biases, mask, structure, t: Tiling):
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
        """Block i's head-major q (grouped), k, v with dead positions zeroed and padded, its
        value as given (for the rows without a key), the structure of its rows and its live
        queries and keys (masking.StructuredMask.live, unpadded)."""
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


def _blocks_forward(query, key, value, biases, mask, structure, t: Tiling):
    """out [B, T, N, Hv] in query's dtype; m, row_sum [B, N, T] in the accumulation dtype."""
    blocks = _Blocks(query, key, biases, mask, structure, t)
    groups = blocks.groups
    acc = accumulation_dtype(t.compute_dtype)

    def block(i):
        q, k, v, raw_v, structure, (live_q, _) = blocks.inputs(query, key, value, i)
        has_key = None
        if live_q is not None:
            has_key = groups.split(_pad_axis(live_q, 2, t.q_len, t.q_pad, True))
        out, m, row_sum = chunked_tiles.forward(
            q, k, v, *blocks.pair(i), structure, has_key, t, groups
        )
        out, m, row_sum = (groups.merge(x)[:, :, : t.q_len] for x in (out, m, row_sum))
        # Rows without a key: numerics' rule, on this block's rows (one output-sized select
        # after the loop would hold a second output).
        out = numerics.uniform_where_no_key(out, raw_v, live_q)
        return jnp.swapaxes(out, 1, 2).astype(query.dtype), m, row_sum  # [rows, T, N, Hv]

    if blocks.count == 1:
        return block(0)
    stats = jnp.zeros((blocks.batch, query.shape[2], t.q_len), acc)  # [B, N, T]
    init = (jnp.zeros((*query.shape[:3], value.shape[3]), query.dtype), stats, stats)
    return blocks.loop(lambda i, start, outs: _put_rows(outs, block(i), start), init)


def _blocks_backward(res, g, g_lse, t: Tiling):
    """(dq, dk, dv, dbiases) of the call, block by block (module docstring)."""
    query, key, value, biases, mask, structure, out, m, row_sum = res
    blocks = _Blocks(query, key, biases, mask, structure, t)
    groups = blocks.groups
    acc = accumulation_dtype(t.compute_dtype)
    shared = [i for i, b in enumerate(biases) if not blocks.batched(b)]

    def block(i):
        q, k, v, raw_v, block_structure, (live_q, live_k) = blocks.inputs(query, key, value, i)
        g_i, out_i = (blocks.head_major(x, i) for x in (g, out))  # [rows, N, T, Hv]
        m_i, sum_i = blocks.rows(m, i), blocks.rows(row_sum, i)  # [rows, N, T]
        g_lse_i = blocks.rows(g_lse, i).astype(acc)  # [rows, N, T]
        d_raw_v = None
        if live_q is not None:
            # Back through the forward's uniform_where_no_key: a row without a key sends its
            # cotangent to the values as given, none into the attention; its lse is a constant.
            finish = lambda o, v: numerics.uniform_where_no_key(o, v, live_q)  # noqa: E731
            g_i, d_raw_v = jax.vjp(finish, out_i, raw_v)[1](g_i)
            g_lse_i = jnp.where(live_q, g_lse_i, 0.0)
        g_i, out_i = (_pad_axis(x, 2, t.q_len, t.q_pad, 0) for x in (g_i, out_i))
        m_i, g_lse_i = (_pad_axis(x, 2, t.q_len, t.q_pad, 0) for x in (m_i, g_lse_i))
        sum_i = _pad_axis(sum_i, 2, t.q_len, t.q_pad, 1)
        g_i, out_i, m_i, sum_i, g_lse_i = (
            groups.split(x) for x in (g_i, out_i, m_i, sum_i, g_lse_i)
        )
        biases_i, mask_i = blocks.pair(i)
        dq, dk, dv, dbias = chunked_tiles.backward(
            q, k, v, biases_i, mask_i, block_structure, out_i, m_i, sum_i, (g_i, g_lse_i), t,
            groups,
        )  # fmt: skip
        dq = groups.merge(dq)[:, :, : t.q_len]
        dk, dv = dk[:, :, : t.kv_len], dv[:, :, : t.kv_len]
        # Back through zero_dead_inputs: zeroed positions take no gradient.
        dq, dk, dv = numerics.zero_dead_inputs(dq, dk, dv, live_q, live_k, head_major=True)
        if d_raw_v is not None:
            dv = dv + d_raw_v.astype(dv.dtype)
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
def _attention(query, key, value, biases, mask, structure, t: Tiling):
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
