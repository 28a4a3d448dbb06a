"""Adapter to cuDNN flash attention through jax.nn.dot_product_attention(implementation='cudnn').

What the adapter does so that cuDNN meets this library's contract (see xla.py):

* layout: our head-major [B, N, T, H] becomes jax.nn's [B, T, N, H] and back;
* bias and mask: cuDNN wants rank-4 tensors whose two sequence dimensions are full ([*, *, T, S]);
  size-1 sequence dimensions are broadcast (batch and head dimensions stay shared), the bias is cast to
  the input dtype (cuDNN's requirement), and jax.nn folds the mask into it;
* fully masked rows: cuDNN's result there is not specified, so rows with no key to attend to are set
  to the uniform average over the keys, exactly what the dense implementation gives;
* what it cannot take (not GPU, float32/float64 inputs, head dims not a multiple of 8 or above 128,
  value head dim different from the key head dim) is reported by `supports`, so 'auto' skips cuDNN
  and an explicit request raises NotImplementedError saying why.

`attend(..., inner_implementation='xla')` runs the same adaptation through jax.nn's XLA path, which is
how the adaptation is tested on machines without a GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gated_attention import xla

CUDNN_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
MAX_HEAD_DIM = 128  # 256 on Hopper and later; 128 holds on every GPU cuDNN flash attention runs on


def supports(query, key, value, biases=(), mask=None, *, backend: str | None = None) -> str | None:
    """None when cuDNN can take these head-major inputs on `backend` (default: JAX's), else why not."""
    del key, biases, mask
    backend = jax.default_backend() if backend is None else backend
    if backend != "gpu":
        return f"cuDNN attention runs on GPU only, the backend is {backend!r}"
    dtype, head_dim = jnp.dtype(query.dtype), query.shape[-1]
    if dtype not in CUDNN_DTYPES:
        return f"cuDNN attention takes float16 or bfloat16 inputs, got {dtype}"
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return (
            f"cuDNN needs a head dim that is a multiple of 8 and <= {MAX_HEAD_DIM}, got {head_dim}"
        )
    if value.shape[-1] != head_dim:
        return f"cuDNN needs equal key and value head dims, got {head_dim} and {value.shape[-1]}"
    return None


def _full_sequence_dims(x, q_len: int, kv_len: int):
    """[b, n, t|1, s|1] -> [b, n, T, S]: broadcast only the sequence dims, as cuDNN requires."""
    return jnp.broadcast_to(x, (*x.shape[:2], q_len, kv_len))


def attend(
    query,
    key,
    value,
    biases=(),
    mask=None,
    *,
    scale: float,
    options=None,
    inner_implementation: str = "cudnn",
) -> jax.Array:
    """cuDNN attention in head-major layout; same arguments and result as xla.attend.

    Args:
      query: [B, N, T, H] float16/bfloat16.
      key: [B, N, S, H].
      value: [B, N, S, H].
      biases: a tuple of float arrays, rank 4, dims 1 or equal to [B, N, T, S]; cuDNN takes one
        bias, so they are summed (at their broadcast shape, sequence dims full).
      mask: None or bool, same broadcast rule.
      scale: logit scale.
      options: unused.
      inner_implementation: jax.nn's implementation to run the adapted call with ('xla' for tests).

    Returns:
      [B, N, T, H] in query's dtype.
    """
    del options
    q_len, kv_len = query.shape[2], key.shape[2]
    to_btnh = lambda x: jnp.swapaxes(x, 1, 2)
    bias = None
    for b in biases:
        bias = b if bias is None else bias + b
    if bias is not None:
        bias = _full_sequence_dims(bias.astype(query.dtype), q_len, kv_len)
    full_mask = None if mask is None else _full_sequence_dims(mask, q_len, kv_len)
    out = jax.nn.dot_product_attention(
        to_btnh(query),
        to_btnh(key),
        to_btnh(value),
        bias,
        full_mask,
        scale=scale,
        implementation=inner_implementation,
    )  # [B, T, N, H]
    return xla.uniform_where_fully_masked(to_btnh(out), value, mask)  # [B, N, T, H]
