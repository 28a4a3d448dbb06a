"""AlphaFold 2's pair bias: the [h, q, k] bias of the layer-normed pair (feat_2d_weights), in
tiles of pair rows that fit the memory budget, and fused with the attention that reads the same
pair (TriangleAttention) so that the bias's cotangent is added into the pair's in place.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp

from gated_attention.core import memory, numerics, platforms
from gated_attention.parallel import row_loop as mapping
from gated_attention.parallel import sharding


def norm_params(name: str, channels: int, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """AF2's LayerNorm parameters '<name>/scale' (ones) and '<name>/offset' (zeros) [channels],
    in float32 (float64 for float64 activations), as hk.LayerNorm creates them for the float32
    input AF2 gives it."""
    acc = numerics.accumulation_dtype(dtype)
    with hk.name_scope(name):
        scale = hk.get_parameter("scale", (channels,), acc, init=jnp.ones)
        offset = hk.get_parameter("offset", (channels,), acc, init=jnp.zeros)
    return scale, offset


def layer_norm(x: jax.Array, norm: tuple[jax.Array, jax.Array]) -> jax.Array:
    """hk.LayerNorm's formula over channels (eps 1e-5), computed and returned in norm's dtype."""
    scale, offset = norm
    x = x.astype(scale.dtype)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    variance = jnp.var(x, axis=-1, keepdims=True)
    return scale * jax.lax.rsqrt(variance + jnp.asarray(1e-5, x.dtype)) * (x - mean) + offset


def normalizer(norm: tuple[jax.Array, jax.Array]) -> Callable[[jax.Array], jax.Array]:
    """The LayerNorm as the attention's input_transform: applied inside each row tile (so it is
    recomputed in the backward pass, not saved whole) and cast back to the input's dtype."""
    return lambda x: layer_norm(x, norm).astype(x.dtype)


def bias_rows(pair, scale, offset, weights):
    """[rows, k, c_z] -> [rows, k, h]: the pair bias of some pair rows, from the float32 (float64)
    LayerNorm output, rounded once to the pair's dtype (AF2's bfloat16 bias; a GPU kernel reads
    half the bytes of a float32 one for every batch row)."""
    normed = layer_norm(pair, (scale, offset))
    bias = jnp.einsum("qkc,ch->qkh", normed, weights.astype(normed.dtype))
    return bias.astype(pair.dtype)


def of_pair(pair_act: jax.Array, norm, num_head: int, dtype: Any, budget: Callable[[str], int]):
    """feat_2d_weights [c_z, h] ~ N(0, 1/c_z) in `dtype`, and the [h, q, k] bias of the
    layer-normed pair, computed in float32 and returned in the pair's dtype (the op adds it to
    float32 logits).

    It runs in tiles of pair rows that fit the memory budget, each recomputed in the backward
    pass: the normed pair and its LayerNorm's cotangents, each the size of the pair (512 MiB at
    N_res 1,024), are never held whole. budget(kind): the tiles' bytes on that platform kind
    (config.Resolved.budget_bytes), decided for each kind the program may be compiled for."""
    weights = feat_2d_weights(pair_act.shape[-1], num_head, dtype)
    args = [pair_act, *(x[None] for x in norm), weights[None]]  # size 1: shared by the tiles
    rows = functools.partial(_tile_rows_on, pair_act.shape, budget)
    return platforms.by_platform(rows, lambda rows: functools.partial(_of_rows, rows), *args)


def _of_rows(rows: int, *args) -> jax.Array:
    """of_pair's bias, `rows` pair rows a tile."""
    batched = [True, False, False, False]
    shared = lambda pair, scale, offset, w: bias_rows(pair, scale[0], offset[0], w[0])
    out = mapping.subbatch(shared, args, subbatch_size=rows, batched=batched, remat=True)
    return jnp.moveaxis(out, -1, 0)  # [h, q, k]


def feat_2d_weights(c_z: int, num_head: int, dtype: Any) -> jax.Array:
    init = hk.initializers.RandomNormal(stddev=1.0 / math.sqrt(c_z))
    return hk.get_parameter("feat_2d_weights", (c_z, num_head), dtype, init=init)


def _tile_rows_on(shape, budget: Callable[[str], int], kind: str) -> int:
    """tile_rows on a platform kind, with that kind's budget."""
    return tile_rows(shape, budget(kind), kind)


def tile_rows(shape: tuple[int, ...], budget_bytes: int, platform: str = "cpu") -> int:
    """Pair rows per bias tile: about six float32 arrays of a row (the normed pair, LayerNorm
    temporaries, cotangents) in a quarter of the budget; the rest holds the attention's tiles and
    the pair's cotangent (memory.pair_bias_tile_rows). On a GPU every row in one tile where they
    fit the whole budget, as the modules' row tiles (modules.rows_per_tile)."""
    q_len, k_len, c_z = shape
    if memory.one_call(platform, q_len * memory.pair_bias_row_bytes(k_len, c_z), budget_bytes):
        return q_len
    return memory.pair_bias_tile_rows(q_len, k_len, c_z, budget_bytes / memory.MIB)


def with_pair(pair_act: jax.Array, norm, num_head: int, dtype: Any, budget: Callable[[str], int]):
    """(pair_act, of_pair(pair_act, ...)) for a module whose attention reads the same pair
    (TriangleAttention): the attention must take the returned pair_act, so that its cotangent
    comes into this function's backward pass, which adds the bias's share into that buffer tile
    by tile. Differentiating of_pair apart would build the bias's pair-sized cotangent beside
    the attention's and add the two: one more pair-sized temporary in a training step. budget:
    as of_pair's."""
    weights = feat_2d_weights(pair_act.shape[-1], num_head, dtype)
    rows = functools.partial(_tile_rows_on, pair_act.shape, budget)
    build = lambda rows: lambda *args: _fused(*args, rows)
    return platforms.by_platform(rows, build, pair_act, *norm, weights)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fused(pair, scale, offset, weights, rows: int):
    shared = lambda pair, scale, offset, w: bias_rows(pair, scale[0], offset[0], w[0])
    args = [pair, scale[None], offset[None], weights[None]]
    out = mapping.subbatch(shared, args, subbatch_size=rows, batched=[True, False, False, False])
    return pair, jnp.moveaxis(out, -1, 0)


def _fused_fwd(pair, scale, offset, weights, rows):
    return _fused(pair, scale, offset, weights, rows), (pair, scale, offset, weights)


def _fused_bwd(rows, residuals, cotangents):
    """The pair's cotangent from the attention, with each tile's bias cotangent added in place
    (a fori_loop carry: no second pair-sized buffer); parameter cotangents summed in float32."""
    pair, scale, offset, weights = residuals
    d_pair, d_bias = cotangents
    d_bias = jnp.moveaxis(d_bias, 0, -1)  # [q, k, h]
    args = (pair, d_pair, d_bias, scale, offset, weights)
    # Pair rows over devices: each device adds its own rows' share, its parameters' partial sums
    # added over the devices.
    out = sharding.map_rows(
        functools.partial(_grads, rows),
        args,
        rows=(True, True, True, False, False, False),
        sums=(False, True, True, True),
    )
    d_pair, d_scale, d_offset, d_weights = out or _grads(rows, *args)
    return (
        d_pair,
        d_scale.astype(scale.dtype),
        d_offset.astype(offset.dtype),
        d_weights.astype(weights.dtype),
    )


def _grads(rows, pair, d_pair, d_bias, scale, offset, weights):
    """(d_pair with each tile's bias cotangent added, the parameters' cotangents in the
    accumulation dtype) over these pair rows, `rows` at a time."""
    acc = numerics.accumulation_dtype(pair.dtype)

    def tile(start, size: int, carry):
        d_pair, *d_params = carry
        piece = jax.lax.dynamic_slice_in_dim(pair, start, size)
        _, vjp = jax.vjp(bias_rows, piece, scale, offset, weights)
        d_piece, *d_tile = vjp(jax.lax.dynamic_slice_in_dim(d_bias, start, size))
        total = jax.lax.dynamic_slice_in_dim(d_pair, start, size) + d_piece.astype(d_pair.dtype)
        d_pair = jax.lax.dynamic_update_slice_in_dim(d_pair, total, start, 0)
        return d_pair, *(a + b.astype(acc) for a, b in zip(d_params, d_tile, strict=True))

    rows = min(rows, pair.shape[0])  # one device's rows may be fewer than a tile
    carry = (d_pair, *(jnp.zeros(x.shape, acc) for x in (scale, offset, weights)))
    return mapping.rows(pair.shape[0], rows, tile, carry)


_fused.defvjp(_fused_fwd, _fused_bwd)
