"""The dense XLA implementation: the specification every other implementation is tested against.

`dense` is the formula, written head-major ([B, N, T, H]) on purpose: on CPU, XLA fuses
'bnqh,bnkh->bnqk', the bias and mask adds and the softmax into one loop nest, where AlphaFold 2's
'bqhc' layout costs 3-11x on CPU (benchmark_results/op_goals). Nothing sits between the logits and the softmax that could
split that fusion, unless asked for (a soft cap, the causal/window/length masks, built from iotas).
Grouped-query attention contracts each key/value head with its group of query heads
(base.Groups): no key or value is repeated.

`XlaAttention` runs `dense` on tiles of batch rows whose float32 logits take about `tile_bytes`,
with the layout change and the compute-dtype cast inside each tile: on CPU, buffers of tens of MiB
are mapped fresh on every call and page faults then dominate (docs/benchmarks.md, "On CPU: glibc's allocator"), and no head-major copy of
the whole query, key and value is made. Each tile is recomputed in the backward pass
(jax.checkpoint), so forward+backward memory is bounded by the tiles too; the structured masks
(masking.py) are built per tile.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gated_attention.attention import base
from gated_attention.core import checks, memory, numerics


@dataclasses.dataclass(frozen=True)
class XlaAttention(base.Implementation):
    """Dense attention in tiles of batch rows.

    Attributes:
      tile_bytes: target float32 logits bytes per tile of batch rows (at least one row a tile).
    """

    name = "xla"
    TAKES = base.ALL_OPTIONS
    tile_bytes: int = memory.TILE_BYTES

    def __post_init__(self):
        checks.check_int("tile_bytes", self.tile_bytes)

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
        batch, q_len, heads, _ = query.shape
        rows = memory.xla_tile_rows(self.tile_bytes, heads, q_len, key.shape[1])
        if rows < batch:  # a bias shared by the tiles sums its gradient over them: in float32
            acc = numerics.accumulation_dtype(compute_dtype)
            biases = tuple(b.astype(acc) if b.shape[0] == 1 else b for b in biases)
        structure = options.structure
        lengths = [structure.q_lengths, structure.kv_lengths]

        def tile(query, key, value, mask, q_lengths, kv_lengths, *biases):  # [b, T, N, H] -> ..
            tile_options = dataclasses.replace(
                options,
                structure=dataclasses.replace(
                    structure, q_lengths=q_lengths, kv_lengths=kv_lengths
                ),
            )
            q, k, v = (jnp.swapaxes(x, 1, 2).astype(compute_dtype) for x in (query, key, value))
            out, lse = dense(q, k, v, biases, mask, scale=scale, options=tile_options)
            out = jnp.swapaxes(out, 1, 2).astype(query.dtype)  # [b, T, N, Hv]
            return (out, lse) if options.return_residual else out

        return base.in_row_tiles(tile, rows, [query, key, value, mask, *lengths, *biases])


def dense(
    query, key, value, biases=(), mask=None, *, scale: float, options: base.Options = base.PLAIN
) -> tuple[jax.Array, jax.Array]:
    """Dense softmax attention in head-major layout: the specification.

    Args:
      query: [B, N, T, H].
      key: [B, K, S, H], K dividing N (query head n uses key head n // (N // K)).
      value: [B, K, S, Hv].
      biases: a tuple of float arrays (added; possibly empty), each broadcastable (dims 1 or equal)
        to [B, N, T, S].
      mask: None or a bool array broadcastable to [B, N, T, S]; False entries are masked out
        (numerics.py: masked positions never leak; fully masked rows are uniform averages).
      scale: multiplies the logits.
      options: the structured masks (lengths [B]), soft cap and precision (base.Options).

    Returns:
      ([B, N, T, Hv] in query's dtype, the logsumexp of the logits [B, N, T] in the accumulation
      dtype; MASK_VALUE + log(S) in rows with no key to attend to).
    """
    acc = numerics.accumulation_dtype(query.dtype)
    structure, precision = options.structure, options.precision
    q_len, kv_len = query.shape[2], key.shape[2]
    groups = base.Groups(key.shape[1], query.shape[1] // key.shape[1])
    live_q, live_k = structure.live(mask, q_len, kv_len)  # [B|1, N|1, T], [B|1, N|1, S]
    q, k, v = numerics.zero_dead_inputs(query, key, value, live_q, live_k, head_major=True)
    # In float32/64 the scale multiplies the [.., T, H] queries, not the [.., T, S] logits (a
    # low-precision query would be rounded again, so there the logits are scaled).
    scale_query = query.dtype == acc
    q = groups.split(q * jnp.asarray(scale, acc) if scale_query else q)  # [B, K, (G,) T, H]
    logits = jnp.einsum(
        groups.qk, q, k, preferred_element_type=acc, precision=precision
    )  # [B, N, T, S] or [B, K, G, T, S]
    if not scale_query:
        logits = logits * jnp.asarray(scale, acc)
    for b in biases:
        logits = logits + groups.split(b).astype(acc)
    logits = numerics.soft_cap(logits, options.logits_soft_cap)
    logits = numerics.mask_logits(logits, groups.split(mask))
    block = structure.block(0, q_len, 0, kv_len)  # [B|1, 1, T|1, S|1]
    if block is not None:
        block = block if groups.size == 1 else block[:, :, None]
        logits = jnp.where(block, logits, jnp.asarray(numerics.MASK_VALUE, acc))
    # Softmax with the normalization deferred past the second matmul: dividing [.., T, Hv] instead
    # of [.., T, S] is cheaper. The shift is a constant per row (no gradient).
    shift = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))  # [.., T, 1]
    unnormalized = jnp.exp(logits - shift)  # [.., T, S]
    out = jnp.einsum(
        groups.pv, unnormalized.astype(v.dtype), v, preferred_element_type=acc, precision=precision
    )  # [B, N, T, Hv] or [B, K, G, T, Hv]
    row_sum = jnp.sum(unnormalized, axis=-1, keepdims=True)
    out = groups.merge(out / row_sum)
    lse = groups.merge((shift + jnp.log(row_sum))[..., 0])  # [B, N, T], d lse / d logits = p
    return numerics.finish_rows_without_key(
        out.astype(query.dtype), lse, value, live_q, True, head_major=True
    )
