"""The dense XLA implementation: the specification every other implementation is tested against.

Head-major layout (see attention.py): query [B, N, T, H], key [B, N, S, H], value [B, N, S, Hv];
bias and mask rank 4 with every dimension 1 or equal to [B, N, T, S].

Written head-major on purpose: on CPU, XLA fuses 'bnqh,bnkh->bnqk', the bias add, the mask select and
the softmax into one loop nest, where AlphaFold 2's 'bqhc' layout costs 3-11x (DESIGN.md). Nothing
sits between the logits and the softmax that could split that fusion.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Masked logits are replaced by this value (not added to): a fully masked row becomes a uniform
# average over the keys, as in AlphaFold 2.
MASK_VALUE = -1e9


def accumulation_dtype(dtype: jnp.dtype) -> jnp.dtype:
    """The dtype logits and softmax are computed in: float32, or float64 for float64 inputs."""
    return jnp.promote_types(dtype, jnp.float32)


def attend(query, key, value, bias=None, mask=None, *, scale: float, options=None) -> jax.Array:
    """Dense softmax attention in head-major layout.

    Args:
      query: [B, N, T, H].
      key: [B, N, S, H].
      value: [B, N, S, Hv].
      bias: None or a float array broadcastable (dims 1 or equal) to [B, N, T, S].
      mask: None or a bool array broadcastable to [B, N, T, S]; False entries are masked out.
      scale: multiplies the logits.
      options: unused here (the dense implementation has nothing to tune).

    Returns:
      [B, N, T, Hv] in query's dtype.
    """
    del options
    acc = accumulation_dtype(query.dtype)
    logits = jnp.einsum("bnqh,bnkh->bnqk", query, key, preferred_element_type=acc)  # [B, N, T, S]
    logits = logits * jnp.asarray(scale, acc)
    if bias is not None:
        logits = logits + bias.astype(acc)
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.asarray(MASK_VALUE, acc))
    weights = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum(
        "bnqk,bnkh->bnqh", weights.astype(value.dtype), value, preferred_element_type=acc
    )  # [B, N, T, Hv]
    return out.astype(query.dtype)
