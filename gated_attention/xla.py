"""The dense XLA implementation: the specification every other implementation is tested against.

Head-major layout (see attention.py): query [B, N, T, H], key [B, N, S, H], value [B, N, S, Hv];
bias and mask rank 4 with every dimension 1 or equal to [B, N, T, S].

Written head-major on purpose: on CPU, XLA fuses 'bnqh,bnkh->bnqk', the bias and mask adds and
the softmax into one loop nest, where AlphaFold 2's 'bqhc' layout costs 3-11x (DESIGN.md). Nothing
sits between the logits and the softmax that could split that fusion.

`dense` is the formula. `row_tile` says how many batch rows it should run on at a time so that one
tile's logits stay near TILE_BYTES: on CPU, buffers of tens of MiB are mapped fresh on every call
and page faults then dominate (DESIGN.md). The op layer (attention.py) runs the tiles, with the
layout change and the compute-dtype cast inside each tile, so that no head-major copy of the whole
query, key and value is made. Every row is computed exactly as `dense` computes it.
scripts/benchmark.py shows the effect (MSA-row and triangle shapes, implementation 'xla' against
AF2's formulation).

Masking adds MASK_VALUE to the masked logits instead of selecting it: masked keys still get exactly
zero weight in every row that has a key to attend to, and rows with none are set to AF2's result
(the uniform average) explicitly. On XLA:CPU the select over the logits ran as a loop of its own,
while the add fuses with the bias add (scripts/benchmark.py: see the MSA-row rows in the README).

The op layer wraps each tile in jax.checkpoint: under differentiation the loop saves only the
tiles' inputs and recomputes a tile's logits in the backward pass, so forward+backward memory is
bounded by the tiles too (otherwise the loop would stack every tile's probabilities: the whole
[B, N, T, S]).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Masked logits are replaced by this value (not added to): a fully masked row becomes a uniform
# average over the keys, as in AlphaFold 2.
MASK_VALUE = -1e9

# Target float32 logits bytes per tile of batch rows (see the module docstring).
TILE_BYTES = 2 * 2**20


def accumulation_dtype(dtype: jnp.dtype) -> jnp.dtype:
    """The dtype logits and softmax are computed in: float32, or float64 for float64 inputs."""
    return jnp.promote_types(dtype, jnp.float32)


# A caller that can run its whole computation per tile of batch rows (the modules: projections,
# attention, gate and output) does so when a TILE_BYTES tile holds at least this many query rows;
# below that its projections' matmuls get too short to gain. scripts/benchmark.py shows the effect
# (triangle shape: tiles of 8 rows x 128 queries; MSA-row shape: 1 row x 256 queries, not tiled).
MIN_CALLER_TILE_QUERIES = 1024


def caller_row_tile(batch: int, row_queries: int, row_logits: int) -> int | None:
    """Batch rows per tile for a caller that tiles its whole computation, or None (don't).

    Args:
      batch: rows of the leading axis.
      row_queries: query positions in one row.
      row_logits: logits (heads x queries x keys) of one row.
    """
    rows = _rows_per_tile(row_logits)
    return rows if rows < batch and rows * row_queries >= MIN_CALLER_TILE_QUERIES else None


def row_tile(batch: int, heads: int, q_len: int, kv_len: int) -> int | None:
    """Batch rows per call of `dense` so that a tile's float32 logits take about TILE_BYTES, or
    None when the whole batch fits (one call)."""
    rows = _rows_per_tile(heads * q_len * kv_len)
    return rows if rows < batch else None


def _rows_per_tile(row_logits: int) -> int:
    """Batch rows whose float32 logits (row_logits per row) take about TILE_BYTES; at least 1."""
    return max(1, TILE_BYTES // (4 * row_logits))


def dense(query, key, value, biases=(), mask=None, *, scale: float, options=None) -> jax.Array:
    """Dense softmax attention in head-major layout: the specification.

    Args:
      query: [B, N, T, H].
      key: [B, N, S, H].
      value: [B, N, S, Hv].
      biases: a tuple of float arrays (added; possibly empty), each broadcastable (dims 1 or equal)
        to [B, N, T, S].
      mask: None or a bool array broadcastable to [B, N, T, S]; False entries are masked out.
      scale: multiplies the logits.
      options: unused here (the dense implementation has nothing to tune).

    Returns:
      [B, N, T, Hv] in query's dtype.
    """
    del options
    acc = accumulation_dtype(query.dtype)
    # In float32/64 the scale multiplies the [.., T, H] queries, not the [.., T, S] logits (a
    # low-precision query would be rounded again, so there the logits are scaled).
    scale_query = query.dtype == acc
    q = query * jnp.asarray(scale, acc) if scale_query else query
    logits = jnp.einsum("bnqh,bnkh->bnqk", q, key, preferred_element_type=acc)  # [B, N, T, S]
    if not scale_query:
        logits = logits * jnp.asarray(scale, acc)
    for b in biases:
        logits = logits + b.astype(acc)
    if mask is not None:
        # Adding MASK_VALUE (see the module docstring) gives masked keys exactly zero weight
        # wherever the row has a key to attend to; rows with none are set below.
        logits = logits + mask_bias(mask, acc)
    # Softmax with the normalization deferred past the second matmul: dividing [.., T, Hv] instead
    # of [.., T, S] saved ~20% at MSA-row shapes. The shift is a constant per row (no gradient).
    shift = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))  # [B, N, T, 1]
    unnormalized = jnp.exp(logits - shift)  # [B, N, T, S]
    out = jnp.einsum(
        "bnqk,bnkh->bnqh", unnormalized.astype(value.dtype), value, preferred_element_type=acc
    )  # [B, N, T, Hv]
    out = out / jnp.sum(unnormalized, axis=-1, keepdims=True)
    return uniform_where_fully_masked(out.astype(query.dtype), value, mask)


def mask_bias(mask: jax.Array, dtype) -> jax.Array:
    """bool mask -> additive bias of the same shape: 0 where True, MASK_VALUE where False."""
    return jnp.where(mask, jnp.asarray(0, dtype), jnp.asarray(MASK_VALUE, dtype))


def uniform_where_fully_masked(out: jax.Array, value: jax.Array, mask) -> jax.Array:
    """Rows of out [B, N, T, Hv] whose mask has no True key become the mean of value over keys.

    This is AlphaFold 2's result for such rows (all logits replaced by the same mask value), and
    what every implementation returns, whatever its arithmetic there. The gradient through those
    rows reaches value only, as in AF2.
    """
    if mask is None:
        return out
    has_key = jnp.any(mask, axis=-1, keepdims=True)  # [B|1, N|1, T|1, 1]
    # The sum over keys as a product with ones (exact in any dtype), not jnp.mean: it then takes
    # the same head-major value as the weighted average's product. For a mean, XLA:CPU made a
    # second transposed copy of value in every row tile (seen in a profile of the MSA-row shape).
    ones = jnp.ones((*value.shape[:2], 1, value.shape[2]), value.dtype)  # [B, N, 1, S]
    acc = accumulation_dtype(value.dtype)
    total = jnp.einsum("bnqk,bnkh->bnqh", ones, value, preferred_element_type=acc)  # [B, N, 1, Hv]
    uniform = total / jnp.asarray(value.shape[2], acc)
    return jnp.where(has_key, out, uniform.astype(out.dtype))
