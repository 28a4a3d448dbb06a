"""A float64 reference of AlphaFold 2's attention algorithms, for tests.

This module shares no code with `gated_attention`; every test of the package compares against it.
Everything is computed in float64. Every function takes an `xp` keyword (default NumPy): pass
`xp=jax.numpy` (with jax's x64 mode on, e.g. inside `with jax.enable_x64(True):`) to run the very
same code under JAX and take float64 reference gradients with `jax.grad`. The code therefore uses
only operations NumPy and jax.numpy share, and no in-place assignment.

Einsum letters (AlphaFold 2's): b batch, q/k query/key positions, h heads, c per-head channel
(key/query), v per-head value channel, a/m query/memory input channels, o output channel,
s/r MSA sequences/residues, z pair channel. For `dot_product_attention` (jax.nn layout): t query
positions, s key positions, n heads, h per-head channel, v per-head value channel.

Numerics (DESIGN.md): logits = scaled q.k (+ biases); masked logits are REPLACED by -1e9 (not added
to), so a fully masked query row gives the uniform average of the values over all keys; softmax over
keys is max-subtracted.
"""

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

# Value that masked logits are replaced with (AlphaFold 2's _SOFTMAX_MASK).
MASK_VALUE = -1e9
# Epsilon in the masked mean of GlobalAttention's query (AF2 Suppl. Alg. 19).
GLOBAL_MEAN_EPS = 1e-10
# Haiku LayerNorm's default epsilon.
LAYER_NORM_EPS = 1e-5

Array = Any  # np.ndarray or jax.Array
Params = Mapping[str, Any]


# ------------------------------------------------------------------------------------------------
# Small helpers
# ------------------------------------------------------------------------------------------------


def _f64(x: Array, xp: Any) -> Array:
    """Casts `x` to a float64 array of the `xp` namespace."""
    return xp.asarray(x, dtype=xp.float64)


def _bool(mask: Array, xp: Any) -> Array:
    """Casts a bool or 0/1 float mask to bool (nonzero means attend, as in jnp.where)."""
    return xp.asarray(mask) != 0


def _f64_params(params: Params, xp: Any) -> dict[str, Any]:
    """Casts every leaf of a (nested) params dict to float64."""
    return {
        k: _f64_params(v, xp) if isinstance(v, Mapping) else _f64(v, xp) for k, v in params.items()
    }


def _sigmoid(x: Array, xp: Any) -> Array:
    """Overflow-free logistic sigmoid."""
    return 0.5 * (1.0 + xp.tanh(0.5 * x))


def _check_rank(name: str, x: Array, rank: int, expected: str) -> None:
    if x.ndim != rank:
        raise ValueError(f"{name} must have rank {rank} ({expected}), got shape {tuple(x.shape)}")


# ------------------------------------------------------------------------------------------------
# Core ops
# ------------------------------------------------------------------------------------------------


def softmax(x: Array, axis: int = -1, *, xp: Any = np) -> Array:
    """Numerically stable softmax in float64.

    Args:
      x: array of any shape.
      axis: the axis to normalize over.
      xp: array namespace (numpy or jax.numpy).

    Returns:
      float64 array of x's shape, summing to 1 along `axis`.
    """
    x = _f64(x, xp)
    shifted = x - xp.max(x, axis=axis, keepdims=True)
    e = xp.exp(shifted)
    return e / xp.sum(e, axis=axis, keepdims=True)


def dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    bias: Array | None = None,
    mask: Array | None = None,
    scale: float | None = None,
    *,
    soft_cap: float | None = None,
    xp: Any = np,
) -> Array:
    """Multi-head scaled dot-product attention in jax.nn's layout, float64.

    logits = scale * q.k (+ bias), then soft_cap * tanh(logits / soft_cap) if soft_cap; masked
    logits are replaced by -1e9; softmax over keys; weighted average of the values. Key/value
    heads K < N are shared by groups of N // K query heads (query head n uses kv head n // (N//K)).

    Args:
      query: [..., T, N, H].
      key: [..., S, K, H], K dividing N.
      value: [..., S, K, Hv].
      bias: None or float array broadcastable to [..., N, T, S], added to the scaled logits.
      mask: None or bool (or 0/1) array broadcastable to [..., N, T, S]; False means "do not attend".
      scale: logit scale; defaults to H**-0.5.
      soft_cap: None or the logits' soft cap (tokamax's logits_soft_cap).
      xp: array namespace (numpy or jax.numpy).

    Returns:
      float64 array [..., T, N, Hv].
    """
    query, key, value = _f64(query, xp), _f64(key, xp), _f64(value, xp)
    if scale is None:
        scale = query.shape[-1] ** -0.5
    group = query.shape[-2] // key.shape[-2]
    key, value = xp.repeat(key, group, axis=-2), xp.repeat(value, group, axis=-2)
    logits = scale * xp.einsum("...tnh,...snh->...nts", query, key)  # [..., N, T, S]
    if bias is not None:
        logits = logits + _f64(bias, xp)
    if soft_cap is not None:
        logits = soft_cap * xp.tanh(logits / soft_cap)
    if mask is not None:
        logits = xp.where(_bool(mask, xp), logits, MASK_VALUE)
    weights = softmax(logits, axis=-1, xp=xp)
    return xp.einsum("...nts,...snv->...tnv", weights, value)  # [..., T, N, Hv]


def attention(
    params: Params,
    q_data: Array,
    m_data: Array,
    mask: Array | None = None,
    nonbatched_bias: Array | None = None,
    bias: Array | None = None,
    *,
    gating: bool = True,
    xp: Any = np,
) -> Array:
    """AlphaFold 2's gated multi-head Attention module (Suppl. Alg. 7/13/14 inner part), float64.

    Args:
      params: dict with query_w [a, h, c], key_w [m, h, c], value_w [m, h, v], output_w [h, v, o],
        output_b [o]; if `gating`, also gating_w [a, h, v] and gating_b [h, v].
      q_data: [b, q, a] queries' input.
      m_data: [b, k, m] keys' and values' input.
      mask: None, a bool (or 0/1) array broadcastable to [b, h, q, k] (rank 4), or a rank-3 [b, q, k]
        mask (each dim may be 1) that applies to every head. False means "do not attend".
      nonbatched_bias: None, [h, q, k], or [q, k] (shared over heads); shared over the batch.
      bias: None or additive float array broadcastable to [b, h, q, k].
      gating: whether to apply the sigmoid gate computed from q_data.
      xp: array namespace (numpy or jax.numpy).

    Returns:
      float64 array [b, q, o].
    """
    p = _f64_params(params, xp)
    q_data, m_data = _f64(q_data, xp), _f64(m_data, xp)
    _check_rank("q_data", q_data, 3, "[b, q, a]")
    _check_rank("m_data", m_data, 3, "[b, k, m]")
    key_dim = p["query_w"].shape[-1]

    q = xp.einsum("bqa,ahc->bqhc", q_data, p["query_w"]) * key_dim**-0.5  # [b, q, h, c]
    k = xp.einsum("bka,ahc->bkhc", m_data, p["key_w"])  # [b, k, h, c]
    v = xp.einsum("bka,ahv->bkhv", m_data, p["value_w"])  # [b, k, h, v]
    logits = xp.einsum("bqhc,bkhc->bhqk", q, k)  # [b, h, q, k]
    if nonbatched_bias is not None:
        nonbatched_bias = _f64(nonbatched_bias, xp)
        if nonbatched_bias.ndim not in (2, 3):
            raise ValueError(
                "nonbatched_bias must have shape [h, q, k] or [q, k], got shape "
                f"{tuple(nonbatched_bias.shape)}"
            )
        logits = logits + nonbatched_bias  # broadcasts as [1, h|1, q, k]
    if bias is not None:
        logits = logits + _f64(bias, xp)
    if mask is not None:
        mask = _bool(mask, xp)
        if mask.ndim == 3:
            mask = mask[:, None, :, :]  # [b, 1, q, k]: every head
        elif mask.ndim != 4:
            raise ValueError(
                "mask must have rank 4 (broadcastable to [b, h, q, k]) or rank 3 ([b, q, k]), got "
                f"shape {tuple(mask.shape)}"
            )
        logits = xp.where(mask, logits, MASK_VALUE)
    weights = softmax(logits, axis=-1, xp=xp)  # [b, h, q, k]
    avg = xp.einsum("bhqk,bkhv->bqhv", weights, v)  # [b, q, h, v]
    if gating:
        gate = _sigmoid(
            xp.einsum("bqa,ahv->bqhv", q_data, p["gating_w"]) + p["gating_b"], xp
        )  # [b, q, h, v]
        avg = avg * gate
    return xp.einsum("bqhv,hvo->bqo", avg, p["output_w"]) + p["output_b"]  # [b, q, o]


def global_attention(
    params: Params,
    q_data: Array,
    m_data: Array,
    q_mask: Array,
    *,
    gating: bool = True,
    xp: Any = np,
) -> Array:
    """AlphaFold 2's GlobalAttention (Suppl. Alg. 19), float64.

    One query per head from the masked mean of q_data over positions; one key/value head shared by
    all heads; keys are masked by the same mask as the queries (they are the same positions).

    Args:
      params: dict with query_w [a, h, c], key_w [m, c], value_w [m, v], output_w [h, v, o],
        output_b [o]; if `gating`, also gating_w [a, h, v] and gating_b [h, v].
      q_data: [b, q, a].
      m_data: [b, k, m] with k == q.
      q_mask: [b, q, 1], float or bool, treated as 0/1.
      gating: whether to gate (then the output differs per query; otherwise it is broadcast).
      xp: array namespace (numpy or jax.numpy).

    Returns:
      float64 array [b, q, o].
    """
    p = _f64_params(params, xp)
    q_data, m_data = _f64(q_data, xp), _f64(m_data, xp)
    _check_rank("q_data", q_data, 3, "[b, q, a]")
    _check_rank("m_data", m_data, 3, "[b, k, m]")
    q_mask = xp.asarray(_bool(q_mask, xp), dtype=xp.float64)
    _check_rank("q_mask", q_mask, 3, "[b, q, 1]")
    key_dim = p["query_w"].shape[-1]

    q_avg = xp.sum(q_mask * q_data, axis=1) / (xp.sum(q_mask, axis=1) + GLOBAL_MEAN_EPS)  # [b, a]
    q = xp.einsum("ba,ahc->bhc", q_avg, p["query_w"]) * key_dim**-0.5  # [b, h, c]
    k = xp.einsum("bka,ac->bkc", m_data, p["key_w"])  # [b, k, c]
    v = xp.einsum("bka,av->bkv", m_data, p["value_w"])  # [b, k, v]
    logits = xp.einsum("bhc,bkc->bhk", q, k)  # [b, h, k]
    key_mask = q_mask[:, None, :, 0] != 0  # [b, 1, k]
    logits = xp.where(key_mask, logits, MASK_VALUE)
    weights = softmax(logits, axis=-1, xp=xp)  # [b, h, k]
    avg = xp.einsum("bhk,bkv->bhv", weights, v)  # [b, h, v]
    if gating:
        gate = _sigmoid(
            xp.einsum("bqa,ahv->bqhv", q_data, p["gating_w"]) + p["gating_b"], xp
        )  # [b, q, h, v]
        gated = avg[:, None] * gate  # [b, q, h, v]
        return xp.einsum("bqhv,hvo->bqo", gated, p["output_w"]) + p["output_b"]  # [b, q, o]
    out = xp.einsum("bhv,hvo->bo", avg, p["output_w"]) + p["output_b"]  # [b, o]
    num_q = q_data.shape[1]
    return xp.broadcast_to(out[:, None, :], (out.shape[0], num_q, out.shape[-1]))  # [b, q, o]


def layer_norm(
    x: Array, scale: Array, offset: Array, eps: float = LAYER_NORM_EPS, *, xp: Any = np
) -> Array:
    """LayerNorm over the last axis (Haiku LayerNorm(axis=-1), biased variance), float64.

    Args:
      x: [..., c].
      scale: [c].
      offset: [c].
      eps: added to the variance.
      xp: array namespace (numpy or jax.numpy).

    Returns:
      float64 array of x's shape.
    """
    x, scale, offset = _f64(x, xp), _f64(scale, xp), _f64(offset, xp)
    mean = xp.mean(x, axis=-1, keepdims=True)
    var = xp.mean((x - mean) ** 2, axis=-1, keepdims=True)
    return (x - mean) / xp.sqrt(var + eps) * scale + offset


# ------------------------------------------------------------------------------------------------
# AlphaFold 2's attention family (no batch axis beyond AF2's own)
# ------------------------------------------------------------------------------------------------


def _norm(norm_params: Params, x: Array, xp: Any) -> Array:
    return layer_norm(x, norm_params["scale"], norm_params["offset"], xp=xp)


def _pair_bias(pair_normed: Array, feat_2d_weights: Array, xp: Any) -> Array:
    """[r, r, z] normalized pair, [z, h] weights -> [h, r, r] nonbatched bias."""
    return xp.einsum("qkz,zh->hqk", pair_normed, _f64(feat_2d_weights, xp))  # [h, q, k]


def msa_row_attention_with_pair_bias(
    params: Params,
    msa_act: Array,
    msa_mask: Array,
    pair_act: Array,
    num_head: int | None = None,
    gating: bool = True,
    *,
    xp: Any = np,
) -> Array:
    """MSA row-wise gated self-attention with pair bias (AF2 Suppl. Alg. 7), float64.

    Args:
      params: {'query_norm': {'scale', 'offset'} [c_m], 'feat_2d_norm': {'scale', 'offset'} [c_z],
        'feat_2d_weights': [c_z, h], 'attention': `attention` params with a = m = o = c_m}.
      msa_act: [s, r, c_m].
      msa_mask: [s, r], bool or 0/1 float.
      pair_act: [r, r, c_z].
      num_head: number of heads; only checked against the params' shapes.
      gating: whether the inner attention is gated.
      xp: array namespace (numpy or jax.numpy).

    Returns:
      float64 array [s, r, c_m].
    """
    _check_num_head(params, num_head)
    msa_normed = _norm(params["query_norm"], msa_act, xp)  # [s, r, c_m]
    pair_normed = _norm(params["feat_2d_norm"], pair_act, xp)  # [r, r, c_z]
    nonbatched_bias = _pair_bias(pair_normed, params["feat_2d_weights"], xp)  # [h, r, r]
    mask = _bool(msa_mask, xp)[:, None, None, :]  # [s, 1, 1, r]
    return attention(
        params["attention"], msa_normed, msa_normed, mask, nonbatched_bias, gating=gating, xp=xp
    )


def msa_column_attention(
    params: Params,
    msa_act: Array,
    msa_mask: Array,
    num_head: int | None = None,
    gating: bool = True,
    *,
    xp: Any = np,
) -> Array:
    """MSA column-wise gated self-attention (AF2 Suppl. Alg. 8), float64.

    Args:
      params: {'query_norm': {'scale', 'offset'} [c_m], 'attention': `attention` params with
        a = m = o = c_m}.
      msa_act: [s, r, c_m].
      msa_mask: [s, r], bool or 0/1 float.
      num_head: number of heads; only checked against the params' shapes.
      gating: whether the inner attention is gated.
      xp: array namespace (numpy or jax.numpy).

    Returns:
      float64 array [s, r, c_m].
    """
    _check_num_head(params, num_head)
    cols = xp.swapaxes(_f64(msa_act, xp), 0, 1)  # [r, s, c_m]
    col_mask = xp.swapaxes(_bool(msa_mask, xp), 0, 1)  # [r, s]
    cols = _norm(params["query_norm"], cols, xp)
    mask = col_mask[:, None, None, :]  # [r, 1, 1, s]
    out = attention(params["attention"], cols, cols, mask, gating=gating, xp=xp)  # [r, s, c_m]
    return xp.swapaxes(out, 0, 1)  # [s, r, c_m]


def msa_column_global_attention(
    params: Params,
    msa_act: Array,
    msa_mask: Array,
    num_head: int | None = None,
    gating: bool = True,
    *,
    xp: Any = np,
) -> Array:
    """MSA column-wise gated global self-attention (AF2 Suppl. Alg. 19), float64.

    Args:
      params: {'query_norm': {'scale', 'offset'} [c_m], 'attention': `global_attention` params
        with a = m = o = c_m}.
      msa_act: [s, r, c_m].
      msa_mask: [s, r], bool or 0/1 float.
      num_head: number of heads; only checked against the params' shapes.
      gating: whether the inner attention is gated.
      xp: array namespace (numpy or jax.numpy).

    Returns:
      float64 array [s, r, c_m].
    """
    _check_num_head(params, num_head)
    cols = xp.swapaxes(_f64(msa_act, xp), 0, 1)  # [r, s, c_m]
    col_mask = xp.swapaxes(_bool(msa_mask, xp), 0, 1)  # [r, s]
    cols = _norm(params["query_norm"], cols, xp)
    out = global_attention(
        params["attention"], cols, cols, col_mask[..., None], gating=gating, xp=xp
    )  # [r, s, c_m]
    return xp.swapaxes(out, 0, 1)  # [s, r, c_m]


def triangle_attention(
    params: Params,
    pair_act: Array,
    pair_mask: Array,
    num_head: int | None = None,
    orientation: str = "per_row",
    gating: bool = True,
    *,
    xp: Any = np,
) -> Array:
    """Triangle gated self-attention around the starting/ending node (AF2 Suppl. Alg. 13/14).

    per_row is the starting-node variant (Alg. 13), per_column the ending-node variant (Alg. 14).

    Args:
      params: {'query_norm': {'scale', 'offset'} [c_z], 'feat_2d_weights': [c_z, h],
        'attention': `attention` params with a = m = o = c_z}.
      pair_act: [r, r, c_z].
      pair_mask: [r, r], bool or 0/1 float.
      num_head: number of heads; only checked against the params' shapes.
      orientation: 'per_row' or 'per_column'.
      gating: whether the inner attention is gated.
      xp: array namespace (numpy or jax.numpy).

    Returns:
      float64 array [r, r, c_z].
    """
    if orientation not in ("per_row", "per_column"):
        raise ValueError(f"orientation must be 'per_row' or 'per_column', got {orientation!r}")
    _check_num_head(params, num_head)
    pair_act, pair_mask = _f64(pair_act, xp), _bool(pair_mask, xp)
    if orientation == "per_column":
        pair_act = xp.swapaxes(pair_act, 0, 1)
        pair_mask = xp.swapaxes(pair_mask, 0, 1)
    pair_normed = _norm(params["query_norm"], pair_act, xp)  # [r, r, c_z]
    nonbatched_bias = _pair_bias(pair_normed, params["feat_2d_weights"], xp)  # [h, r, r]
    mask = pair_mask[:, None, None, :]  # [r, 1, 1, r]
    out = attention(
        params["attention"], pair_normed, pair_normed, mask, nonbatched_bias, gating=gating, xp=xp
    )  # [r, r, c_z]
    if orientation == "per_column":
        out = xp.swapaxes(out, 0, 1)
    return out


def _check_num_head(params: Params, num_head: int | None) -> None:
    """Checks num_head (if given) against the inner attention's output_w [h, v, o]."""
    if num_head is None:
        return
    heads = params["attention"]["output_w"].shape[0]
    if num_head != heads:
        raise ValueError(f"num_head={num_head!r} does not match the params' {heads} heads")


# ------------------------------------------------------------------------------------------------
# Tolerances for comparing an implementation (in `dtype`) against this float64 reference
# ------------------------------------------------------------------------------------------------

# Calibrated (tests/reference.py's author, jax 0.10.2 CPU) with a contract-following implementation in
# each dtype (projections in the dtype, logits/softmax in float32, weights cast to v's dtype) against
# this reference fed the SAME dtype-rounded inputs and params; N(0, 1) inputs, params from the
# random_*_params builders below (outputs: std ~0.55, max ~3.4); b*q*k up to 4*32*48, a up to 256,
# 12 seeds. "needed" = max |actual - expected| / (1 + |expected|), i.e. rtol = atol = needed passes.
#   dtype     Attention module needed -> picked      family (triangle, LN in dtype) needed -> picked
#   float32   1.1e-6 -> 1e-5                          1.4e-6 -> 1e-5
#   float16   1.7e-3 -> 5e-3                          3.9e-3 -> 1.2e-2
#   bfloat16  1.2e-2 -> 4e-2                          2.9e-2 -> 8e-2
# Feeding the reference the UNROUNDED inputs costs up to 1.6x more error in float16/bfloat16.
# float64 differs only by operation order (~1e-15); 1e-10 leaves room for long reductions.
_TOLERANCES = {
    "float64": dict(rtol=1e-10, atol=1e-10),
    "float32": dict(rtol=1e-5, atol=1e-5),
    "float16": dict(rtol=5e-3, atol=5e-3),
    "bfloat16": dict(rtol=4e-2, atol=4e-2),
    # float32 with TF32 dots (a GPU's default: inputs rounded to 10 mantissa bits): needed 7.9e-4
    # forward, 6.5e-4 for gradients (tests/test_reference.py emulates it with lax.reduce_precision).
    "tf32": dict(rtol=4e-3, atol=4e-3),
}
_FAMILY_TOLERANCES = {
    **_TOLERANCES,
    "float16": dict(rtol=1.2e-2, atol=1.2e-2),
    "bfloat16": dict(rtol=8e-2, atol=8e-2),
    "tf32": dict(rtol=8e-3, atol=8e-3),
}
# Gradients w.r.t. weights are sums over every position with cancellation, so their elementwise error
# scales with the LARGEST gradient entry, not with each entry: atol is relative to
# max(1, max |expected|) (see grad_tolerance). Measured max |err| / (max(1, max|g|) + |g|), module
# and triangle family: float32 8.8e-7, float16 4.5e-3, bfloat16 3.4e-2.
_GRAD_TOLERANCES = {
    "float64": dict(rtol=1e-9, atol=1e-9),
    "float32": dict(rtol=2e-5, atol=2e-5),
    "float16": dict(rtol=1.2e-2, atol=1.2e-2),
    "bfloat16": dict(rtol=1e-1, atol=1e-1),
    "tf32": dict(rtol=5e-3, atol=5e-3),
}
# What a float32 dot at JAX's default precision rounds its inputs to, per platform: one TF32 pass on
# a GPU's tensor cores, one bfloat16 pass on a TPU's MXU (XLA's dots and the kernels alike).
FLOAT32_DOTS = {"cpu": "float32", "gpu": "tf32", "tpu": "bfloat16"}


def computed_as(dtype: Any, platform: str | None = None) -> str:
    """The tolerance key of results computed in `dtype` on `platform` ('cpu', 'gpu', 'tpu'; None:
    JAX's default backend): float32 takes FLOAT32_DOTS' rounding there, other dtypes their name."""
    name = _dtype_name(dtype)
    if name != "float32":
        return name
    if platform is None:
        import jax  # only here: the reference itself is NumPy

        platform = jax.default_backend()
    return FLOAT32_DOTS["gpu" if platform in ("cuda", "rocm") else platform]


def _dtype_name(dtype: Any) -> str:
    if not isinstance(dtype, (str, type, np.dtype)):
        dtype = getattr(dtype, "dtype", dtype)  # an array
    if isinstance(dtype, str):
        return dtype
    try:
        return np.dtype(dtype).name
    except TypeError as e:
        raise TypeError(f"dtype must be a NumPy/JAX dtype or its name, got {dtype!r}") from e


def _lookup(table: Mapping[str, dict[str, float]], dtype: Any) -> dict[str, float]:
    name = _dtype_name(dtype)
    if name not in table:
        raise ValueError(f"dtype must be one of {sorted(table)}, got {name!r}")
    return dict(table[name])


def tolerance(dtype: Any, *, family: bool = False, platform: str | None = None) -> dict[str, float]:
    """Tolerances to compare an output computed in `dtype` against this float64 reference.

    Feed the reference the same dtype-rounded inputs and params the implementation saw.

    Args:
      dtype: float64, float32, float16, bfloat16 (a dtype, scalar type, name, or an array) or tf32.
      family: True for AF2's family modules (their LayerNorm and pair-bias projection also round).
      platform: where it was computed (None: JAX's default backend); float32 there is judged as
        its default dots round it (computed_as: TF32 on a GPU).

    Returns:
      dict(rtol=..., atol=...) for np.testing.assert_allclose, for O(1)-magnitude values.
    """
    return _lookup(_FAMILY_TOLERANCES if family else _TOLERANCES, computed_as(dtype, platform))


def grad_tolerance(
    dtype: Any, expected: Array | None = None, *, platform: str | None = None
) -> dict[str, float]:
    """Like `tolerance`, for gradients computed in `dtype` (looser; same for op, modules, family).

    Args:
      dtype: float64, float32, float16, bfloat16 or tf32.
      expected: the reference gradient. If given, atol is scaled by max(1, max |expected|), because
        a weight gradient's elementwise error scales with its largest entry. Pass it whenever the
        gradient is not O(1) (weight gradients summed over many positions).
      platform: as for `tolerance`.

    Returns:
      dict(rtol=..., atol=...) for np.testing.assert_allclose.
    """
    tol = _lookup(_GRAD_TOLERANCES, computed_as(dtype, platform))
    if expected is not None:
        tol["atol"] *= max(1.0, float(np.max(np.abs(np.asarray(expected, dtype=np.float64)))))
    return tol


# ------------------------------------------------------------------------------------------------
# Random float64 parameters with O(1) outputs
# ------------------------------------------------------------------------------------------------


def _normal(rng: np.random.Generator, shape: tuple[int, ...], fan_in: int) -> np.ndarray:
    return rng.normal(0.0, 1.0 / math.sqrt(fan_in), size=shape)


def random_attention_params(
    rng: np.random.Generator,
    a: int,
    m: int,
    h: int,
    c: int,
    cv: int,
    o: int,
    gating: bool = True,
) -> dict[str, np.ndarray]:
    """Random float64 `attention` params giving O(1) outputs for N(0, 1) inputs.

    Weights are normal with stddev 1/sqrt(fan_in) (so projections and logits are O(1)); the gate and
    output weights/biases are nonzero, so every parameter influences the output.

    Args:
      rng: NumPy random Generator.
      a: query input channels. m: memory input channels. h: heads. c: per-head key channels.
      cv: per-head value channels. o: output channels.
      gating: whether to include gating_w / gating_b.

    Returns:
      dict with query_w [a, h, c], key_w [m, h, c], value_w [m, h, cv], output_w [h, cv, o],
      output_b [o], and if gating gating_w [a, h, cv], gating_b [h, cv].
    """
    params = {
        "query_w": _normal(rng, (a, h, c), a),
        "key_w": _normal(rng, (m, h, c), m),
        "value_w": _normal(rng, (m, h, cv), m),
        # 2x the 1/sqrt(fan_in) scale: the weighted average and the gate shrink the values.
        "output_w": 2.0 * _normal(rng, (h, cv, o), h * cv),
        "output_b": rng.normal(0.0, 0.1, size=(o,)),
    }
    if gating:
        params["gating_w"] = _normal(rng, (a, h, cv), a)
        params["gating_b"] = 1.0 + rng.normal(0.0, 0.5, size=(h, cv))  # AF2 inits to ones
    return params


def random_global_attention_params(
    rng: np.random.Generator,
    a: int,
    m: int,
    h: int,
    c: int,
    cv: int,
    o: int,
    gating: bool = True,
) -> dict[str, np.ndarray]:
    """Random float64 `global_attention` params giving O(1) outputs for N(0, 1) inputs.

    Args:
      rng: NumPy random Generator.
      a: query input channels. m: memory input channels. h: heads. c: key channels.
      cv: value channels. o: output channels.
      gating: whether to include gating_w / gating_b.

    Returns:
      dict with query_w [a, h, c], key_w [m, c], value_w [m, cv], output_w [h, cv, o],
      output_b [o], and if gating gating_w [a, h, cv], gating_b [h, cv].
    """
    params = random_attention_params(rng, a, m, h, c, cv, o, gating)
    params["key_w"] = _normal(rng, (m, c), m)
    params["value_w"] = _normal(rng, (m, cv), m)
    return params


def random_layer_norm_params(rng: np.random.Generator, c: int) -> dict[str, np.ndarray]:
    """Random LayerNorm params: scale ~ 1 + 0.1 * noise [c], offset ~ 0.1 * noise [c]."""
    return {
        "scale": 1.0 + 0.1 * rng.normal(size=(c,)),
        "offset": 0.1 * rng.normal(size=(c,)),
    }


def _per_head(channels: int, num_head: int) -> int:
    if channels % num_head:
        raise ValueError(f"channels={channels} must be divisible by num_head={num_head}")
    return channels // num_head


def _inner_attention_params(
    rng: np.random.Generator, c: int, num_head: int, gating: bool
) -> dict[str, np.ndarray]:
    d = _per_head(c, num_head)
    return random_attention_params(rng, c, c, num_head, d, d, c, gating)


def random_msa_row_attention_params(
    rng: np.random.Generator, c_m: int, c_z: int, num_head: int, gating: bool = True
) -> dict[str, Any]:
    """Random params for `msa_row_attention_with_pair_bias` (AF2 defaults: key/value dim c_m/h).

    Returns:
      {'query_norm': {scale, offset} [c_m], 'feat_2d_norm': {scale, offset} [c_z],
       'feat_2d_weights': [c_z, h], 'attention': `random_attention_params` with a = m = o = c_m}.
    """
    return {
        "query_norm": random_layer_norm_params(rng, c_m),
        "feat_2d_norm": random_layer_norm_params(rng, c_z),
        "feat_2d_weights": _normal(rng, (c_z, num_head), c_z),
        "attention": _inner_attention_params(rng, c_m, num_head, gating),
    }


def random_msa_column_attention_params(
    rng: np.random.Generator, c_m: int, num_head: int, gating: bool = True
) -> dict[str, Any]:
    """Random params for `msa_column_attention`: {'query_norm', 'attention'}."""
    return {
        "query_norm": random_layer_norm_params(rng, c_m),
        "attention": _inner_attention_params(rng, c_m, num_head, gating),
    }


def random_msa_column_global_attention_params(
    rng: np.random.Generator, c_m: int, num_head: int, gating: bool = True
) -> dict[str, Any]:
    """Random params for `msa_column_global_attention`: {'query_norm', 'attention' (global)}."""
    d = _per_head(c_m, num_head)
    return {
        "query_norm": random_layer_norm_params(rng, c_m),
        "attention": random_global_attention_params(rng, c_m, c_m, num_head, d, d, c_m, gating),
    }


def random_triangle_attention_params(
    rng: np.random.Generator, c_z: int, num_head: int, gating: bool = True
) -> dict[str, Any]:
    """Random params for `triangle_attention`: {'query_norm', 'feat_2d_weights' [c_z, h],
    'attention'}."""
    return {
        "query_norm": random_layer_norm_params(rng, c_z),
        "feat_2d_weights": _normal(rng, (c_z, num_head), c_z),
        "attention": _inner_attention_params(rng, c_z, num_head, gating),
    }
