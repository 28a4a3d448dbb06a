"""The dense XLA implementation: the specification every other implementation is tested against.

`dense` is the formula, written head-major ([B, N, T, H]) on purpose: on CPU, XLA fuses
'bnqh,bnkh->bnqk', the bias and mask adds and the softmax into one loop nest, where AlphaFold 2's
'bqhc' layout costs 3-11x (DESIGN.md). Nothing sits between the logits and the softmax that could
split that fusion.

`XlaAttention` runs `dense` on tiles of batch rows whose float32 logits take about `tile_bytes`,
with the layout change and the compute-dtype cast inside each tile: on CPU, buffers of tens of MiB
are mapped fresh on every call and page faults then dominate (DESIGN.md), and no head-major copy of
the whole query, key and value is made. Each tile is recomputed in the backward pass
(jax.checkpoint), so forward+backward memory is bounded by the tiles too.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gated_attention import base, checks, numerics


@dataclasses.dataclass(frozen=True)
class XlaAttention(base.Implementation):
    """Dense attention in tiles of batch rows.

    Attributes:
      tile_bytes: target float32 logits bytes per tile of batch rows (at least one row a tile).
    """

    name = "xla"
    tile_bytes: int = 2 * 2**20

    def __post_init__(self):
        checks.check_int("tile_bytes", self.tile_bytes)

    def __call__(self, query, key, value, biases, mask, *, scale, compute_dtype):
        batch, q_len, heads, _ = query.shape
        rows = max(1, self.tile_bytes // (4 * heads * q_len * key.shape[1]))
        if rows < batch:  # a bias shared by the tiles sums its gradient over them: in float32
            acc = numerics.accumulation_dtype(compute_dtype)
            biases = tuple(b.astype(acc) if b.shape[0] == 1 else b for b in biases)

        def tile(query, key, value, mask, *biases):  # [b, T, N, H] -> [b, T, N, Hv]
            q, k, v = (jnp.swapaxes(x, 1, 2).astype(compute_dtype) for x in (query, key, value))
            out = dense(q, k, v, biases, mask, scale=scale)
            return jnp.swapaxes(out, 1, 2).astype(query.dtype)

        return base.in_row_tiles(tile, rows, [query, key, value, mask, *biases])


def dense(query, key, value, biases=(), mask=None, *, scale: float) -> jax.Array:
    """Dense softmax attention in head-major layout: the specification.

    Args:
      query: [B, N, T, H].
      key: [B, N, S, H].
      value: [B, N, S, Hv].
      biases: a tuple of float arrays (added; possibly empty), each broadcastable (dims 1 or equal)
        to [B, N, T, S].
      mask: None or a bool array broadcastable to [B, N, T, S]; False entries are masked out
        (numerics.py: masked positions never leak; fully masked rows are uniform averages).
      scale: multiplies the logits.

    Returns:
      [B, N, T, Hv] in query's dtype.
    """
    acc = numerics.accumulation_dtype(query.dtype)
    q, k, v = numerics.zero_masked_inputs(query, key, value, mask, head_major=True)
    # In float32/64 the scale multiplies the [.., T, H] queries, not the [.., T, S] logits (a
    # low-precision query would be rounded again, so there the logits are scaled).
    scale_query = query.dtype == acc
    q = q * jnp.asarray(scale, acc) if scale_query else q
    logits = jnp.einsum("bnqh,bnkh->bnqk", q, k, preferred_element_type=acc)  # [B, N, T, S]
    if not scale_query:
        logits = logits * jnp.asarray(scale, acc)
    for b in biases:
        logits = logits + b.astype(acc)
    logits = numerics.mask_logits(logits, mask)
    # Softmax with the normalization deferred past the second matmul: dividing [.., T, Hv] instead
    # of [.., T, S] is cheaper. The shift is a constant per row (no gradient).
    shift = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))  # [B, N, T, 1]
    unnormalized = jnp.exp(logits - shift)  # [B, N, T, S]
    out = jnp.einsum(
        "bnqk,bnkh->bnqh", unnormalized.astype(v.dtype), v, preferred_element_type=acc
    )  # [B, N, T, Hv]
    out = out / jnp.sum(unnormalized, axis=-1, keepdims=True)
    return numerics.uniform_where_fully_masked(out.astype(query.dtype), value, mask)
