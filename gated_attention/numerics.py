"""The numerics every implementation shares: dtypes, the precision policy and how a mask applies.

Accumulation. Logits, softmax and the weighted sum accumulate in float32 whatever the input dtype
(float64 for float64 inputs): `accumulation_dtype`.

Precision policy (global_config.compute_dtype, dot_product_attention's `compute_dtype`). CPUs have
no bfloat16/float16 arithmetic: XLA:CPU converts such operands around every dot and elementwise op,
so computing in them is slower than float32 and less accurate. Policies:
  'auto': float32 for bfloat16/float16 inputs on CPU, the input dtype otherwise.
  'input': always the input dtype (AlphaFold 2's behaviour).
  'float32': float32 for bfloat16/float16 inputs on every backend.
float32 and float64 inputs are always computed as given; outputs keep the input dtype.

Masks. A boolean mask [B|1, N|1, T|1, S|1] (True = attend) applies in three steps, each an
implementation's to take inside its own tiles:
  1. `zero_masked_inputs`: queries whose row has no key, and keys (and values) that no query of
     their batch row and head attends to, are set to zero. Whatever those positions held (NaN,
     inf, 1e12 padding garbage) then reaches no unmasked output and no gradient of an unmasked
     input. This costs O(T·H + S·H), not a pass over the [.., T, S] logits.
  2. `mask_logits`: masked logits get MASK_VALUE. A mask over keys alone (T dimension 1) is added
     as a bias, which XLA fuses with the logits (a select ran as a loop of its own on XLA:CPU);
     after step 1 its masked logits are finite, so the add is exact. A mask with a T dimension
     can mask a key for some rows while others attend to it, so it is applied by a select: no
     value of such a key reaches the rows that mask it, through the logits.
  3. `uniform_where_fully_masked`: a row with no key to attend to gives the uniform average of
     the values over all keys, AlphaFold 2's result (every logit replaced by the same value).
A value that one row attends to and another masks still meets the masking row's zero weight in
the weighted sum, so a NaN there reaches both rows (as in jax.nn.dot_product_attention).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Masked logits get this value: a fully masked row becomes a uniform average, as in AlphaFold 2.
MASK_VALUE = -1e9

POLICIES = ("auto", "input", "float32")

_LOW_PRECISION = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def accumulation_dtype(dtype) -> jnp.dtype:
    """The dtype logits and softmax are computed in: float32, or float64 for float64 inputs."""
    return jnp.promote_types(dtype, jnp.float32)


def check_policy(name: str, policy) -> None:
    """Raises ValueError naming `name` unless policy is one of POLICIES."""
    if policy not in POLICIES:
        raise ValueError(f"{name} must be one of {POLICIES}, got {policy!r}")


def compute_dtype(dtype, policy: str = "auto", backend: str | None = None) -> jnp.dtype:
    """The dtype to compute in for inputs of `dtype` under `policy` on `backend`.

    Args:
      dtype: the inputs' float dtype.
      policy: one of POLICIES (validated by the caller's boundary).
      backend: platform name; None: jax.default_backend().

    Returns:
      float32 for a bfloat16/float16 dtype when the policy asks for it ('float32', or 'auto' on
      CPU), else dtype itself.
    """
    dtype = jnp.dtype(dtype)
    if dtype not in _LOW_PRECISION or policy == "input":
        return dtype
    if policy == "float32":
        return jnp.dtype(jnp.float32)
    backend = jax.default_backend() if backend is None else backend
    return jnp.dtype(jnp.float32) if backend == "cpu" else dtype


def cast_floats(tree, dtype):
    """Every floating-point leaf of `tree` cast to dtype (other leaves, e.g. bool masks, unchanged)."""
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(jnp.result_type(x), jnp.floating) else x,
        tree,
    )


def zero_masked_inputs(query, key, value, mask, *, head_major: bool):
    """Queries with no key to attend to, and keys/values no query attends to, set to zero.

    Args:
      query: [B, T, N, H] (head_major=False) or [B, N, T, H] (head_major=True).
      key: [B, S, N, H] or [B, N, S, H].
      value: [B, S, N, Hv] or [B, N, S, Hv].
      mask: None or bool [B|1, N|1, T|1, S|1].
      head_major: the layout of query, key and value.

    Returns:
      (query, key, value), unchanged where mask is None.
    """
    if mask is None:
        return query, key, value
    live_queries = jnp.any(mask, axis=3)  # [B|1, N|1, T|1]
    live_keys = jnp.any(mask, axis=2)  # [B|1, N|1, S|1]
    if not head_major:
        live_queries, live_keys = (jnp.swapaxes(x, 1, 2) for x in (live_queries, live_keys))
    zero = lambda x, live: jnp.where(live[..., None], x, jnp.zeros((), x.dtype))
    return zero(query, live_queries), zero(key, live_keys), zero(value, live_keys)


def mask_logits(logits, mask):
    """logits [B, N, T, S] (accumulation dtype) with MASK_VALUE at the masked entries.

    A key-only mask (T dimension 1) is added, a mask with a T dimension selected (module
    docstring). mask: None or bool [B|1, N|1, T|1, S|1].
    """
    if mask is None:
        return logits
    masked = jnp.asarray(MASK_VALUE, logits.dtype)
    if mask.shape[2] == 1:
        return logits + jnp.where(mask, jnp.zeros((), logits.dtype), masked)
    return jnp.where(mask, logits, masked)


def uniform_where_fully_masked(out, value, mask, *, head_major: bool = True):
    """Rows of out whose mask has no True key become the mean of value over keys.

    AlphaFold 2's result for such rows, and what every implementation returns. The gradient of
    those rows reaches value only.

    Args:
      out: [B, N, T, Hv] (head_major) or [B, T, N, Hv].
      value: [B, N, S, Hv] or [B, S, N, Hv], as given (not zeroed).
      mask: None or bool [B|1, N|1, T|1, S|1].
      head_major: the layout of out and value.
    """
    if mask is None:
        return out
    has_key = jnp.any(mask, axis=-1, keepdims=True)  # [B|1, N|1, T|1, 1]
    acc = accumulation_dtype(value.dtype)
    if head_major:
        # The sum over keys as a product with ones (exact in any dtype): it shares the head-major
        # value of the weighted average, where a mean made XLA:CPU copy value again.
        ones = jnp.ones((*value.shape[:2], 1, value.shape[2]), value.dtype)  # [B, N, 1, S]
        total = jnp.einsum("bnqk,bnkh->bnqh", ones, value, preferred_element_type=acc)
    else:
        has_key = jnp.swapaxes(has_key, 1, 2)  # [B|1, T|1, N|1, 1]
        total = jnp.sum(value, axis=1, keepdims=True, dtype=acc)  # [B, 1, N, Hv]
    uniform = total / jnp.asarray(value.shape[-2 if head_major else 1], acc)
    return jnp.where(has_key, out, uniform.astype(out.dtype))
