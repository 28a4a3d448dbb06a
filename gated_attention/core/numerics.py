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

Masks. A boolean mask [B|1, N|1, T|1, S|1] (True = attend) and the structured masks
(masking.StructuredMask: causal, window, lengths) apply in three steps, each an implementation's to
take inside its own tiles:
  1. `zero_dead_inputs`: queries with no key to attend to, and keys (and values) that no query of
     their batch row and head attends to, are set to zero; masking.StructuredMask.live says which,
     exactly, from the mask's prefix counts. Whatever those positions held (NaN, inf, 1e12
     padding garbage) then reaches no unmasked output and no gradient of an unmasked input. This
     costs O(T·H + S·H), not a pass over the [.., T, S] logits.
  2. `mask_logits`: masked logits get MASK_VALUE. A mask over keys alone (T dimension 1) is added
     as a bias, which XLA fuses with the logits (a select ran as a loop of its own on XLA:CPU);
     after step 1 its masked logits are finite, so the add is exact. A mask with a T dimension
     can mask a key for some rows while others attend to it, so it is applied by a select: no
     value of such a key reaches the rows that mask it, through the logits. The structured
     masks' per-tile blocks are selected likewise.
  3. `finish_rows_without_key` (`uniform_where_no_key` for the output alone): a row with no key
     to attend to gives the uniform average of the values over all keys, AlphaFold 2's result
     (every logit replaced by the same value), and the log-sum-exp MASK_VALUE + log(S). Every
     implementation calls it on its result, outside its kernels; chunked calls
     `uniform_where_no_key` on each block of rows in its loop (its backward pass is that
     function's VJP), and its statistics give such a row that log-sum-exp.
A value that one row attends to and another masks still meets the masking row's zero weight in
the weighted sum, so a NaN there reaches both rows (as in jax.nn.dot_product_attention).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from gated_attention.core import platforms

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
      backend: platform name or kind; None: the host's (platforms.host()).

    Returns:
      float32 for a bfloat16/float16 dtype when the policy asks for it ('float32', or 'auto' on
      CPU), else dtype itself.
    """
    dtype = jnp.dtype(dtype)
    if dtype not in _LOW_PRECISION or policy == "input":
        return dtype
    if policy == "float32":
        return jnp.dtype(jnp.float32)
    kind = platforms.host() if backend is None else platforms.kind(backend)
    return jnp.dtype(jnp.float32) if kind == "cpu" else dtype


def cast_floats(tree, dtype):
    """Every floating-point leaf of `tree` cast to dtype (other leaves, e.g. bool masks, unchanged)."""
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(jnp.result_type(x), jnp.floating) else x,
        tree,
    )


def zero_dead_inputs(query, key, value, live_queries, live_keys, *, head_major: bool):
    """Queries with no key to attend to, and keys/values no query attends to, set to zero.

    Args:
      query: [B, T, N, H] (head_major=False) or [B, N, T, H] (head_major=True).
      key: [B, S, K, H] or [B, K, S, H], K dividing N (grouped-query attention).
      value: [B, S, K, Hv] or [B, K, S, Hv].
      live_queries: None or bool [B|1, N|1, T|1]: queries with a key to attend to.
      live_keys: None or bool [B|1, N|1, S|1]: keys some query of that head attends to (a
        key/value head is live where any of its query heads is).
      head_major: the layout of query, key and value.
    """
    heads_axis = 1 if head_major else 2
    heads, kv_heads = query.shape[heads_axis], key.shape[heads_axis]
    if live_keys is not None and live_keys.shape[1] != 1 and kv_heads != heads:
        live_keys = live_keys.reshape((live_keys.shape[0], kv_heads, -1, live_keys.shape[2]))
        live_keys = live_keys.any(axis=2)  # [B|1, K, S|1]

    def zero(x, live):
        if live is None:
            return x
        live = live if head_major else jnp.swapaxes(live, 1, 2)
        return jnp.where(live[..., None], x, jnp.zeros((), x.dtype))

    return zero(query, live_queries), zero(key, live_keys), zero(value, live_keys)


def mask_logits(logits, mask):
    """logits [B, N, T, S] (accumulation dtype) with MASK_VALUE at the masked entries.

    A key-only mask (T dimension 1) is added, a mask with a T dimension selected (module
    docstring). mask: None or bool [B|1, N|1, T|1, S|1] (or, grouped, [B|1, K|1, G|1, T|1, S|1]
    with logits [B, K, G, T, S]).
    """
    if mask is None:
        return logits
    masked = jnp.asarray(MASK_VALUE, logits.dtype)
    if mask.shape[-2] == 1:
        return logits + jnp.where(mask, jnp.zeros((), logits.dtype), masked)
    return jnp.where(mask, logits, masked)


def soft_cap(logits, cap: float | None):
    """cap * tanh(logits / cap) (tokamax's logits_soft_cap), or logits where cap is None."""
    if cap is None:
        return logits
    cap = jnp.asarray(cap, logits.dtype)
    return cap * jnp.tanh(logits / cap)


def uniform_where_no_key(
    out, value, has_key, *, head_major: bool = True, positions_first: bool = False
):
    """Rows of out with no key to attend to become the mean of value over keys (AlphaFold 2's
    result for such rows); their gradient reaches value only.

    Args:
      out: [B, N, T, Hv] (head_major) or [B, T, N, Hv].
      value: [B, K, S, Hv] or [B, S, K, Hv], as given, K dividing N: query head n gets the mean
        of value head n // (N // K).
      has_key: None or bool [B|1, N|1, T|1]: rows with a key to attend to.
      head_major: the layout of out and value.
      positions_first: out [T, B, N, Hv] and value [S, B, K, Hv] instead (not head_major).
    """
    if has_key is None:
        return out
    acc = accumulation_dtype(value.dtype)
    heads_axis = 1 if head_major else 2
    if head_major:
        # The sum over keys as a product with ones (exact in any dtype): it shares the head-major
        # value of the weighted average, where a mean made XLA:CPU copy value again.
        ones = jnp.ones((*value.shape[:2], 1, value.shape[2]), value.dtype)  # [B, K, 1, S]
        total = jnp.einsum("bnqk,bnkh->bnqh", ones, value, preferred_element_type=acc)
        has_key = has_key[..., None]  # [B|1, N|1, T|1, 1]
    elif positions_first:
        total = jnp.sum(value, axis=0, keepdims=True, dtype=acc)  # [1, B, K, Hv]
        has_key = jnp.transpose(has_key, (2, 0, 1))[..., None]  # [T|1, B|1, N|1, 1]
    else:
        total = jnp.sum(value, axis=1, keepdims=True, dtype=acc)  # [B, 1, K, Hv]
        has_key = jnp.swapaxes(has_key, 1, 2)[..., None]  # [B|1, T|1, N|1, 1]
    keys = value.shape[-2 if head_major else 0 if positions_first else 1]
    uniform = (total / jnp.asarray(keys, acc)).astype(out.dtype)
    heads, kv_heads = out.shape[heads_axis], value.shape[heads_axis]
    if kv_heads == heads:
        return jnp.where(has_key, out, uniform)
    split = lambda x, n: x.reshape((*x.shape[:heads_axis], n, -1, *x.shape[heads_axis + 1 :]))
    has_key = has_key if has_key.shape[heads_axis] == 1 else split(has_key, kv_heads)
    if has_key.ndim == out.ndim:
        has_key = jnp.expand_dims(has_key, heads_axis + 1)
    uniform = jnp.expand_dims(uniform, heads_axis + 1)  # [.., K, 1, ..]
    return jnp.where(has_key, split(out, kv_heads), uniform).reshape(out.shape)


def finish_rows_without_key(
    out, lse, value, live_q, return_residual: bool, *, head_major: bool = False,
    positions_first: bool = False,
):  # fmt: skip
    """An implementation's (out, lse [B, N, T]) as the op returns it: rows with no key to attend
    to get the uniform average of the values and the log-sum-exp MASK_VALUE + log(S), the same
    in every implementation; out alone unless return_residual.

    Args:
      out: [B, T, N, Hv], or [B, N, T, Hv] with head_major, [T, B, N, Hv] with positions_first.
      lse: [B, N, T] in the accumulation dtype, or None when not return_residual.
      value: [B, S, K, Hv] (or [B, K, S, Hv] with head_major, [S, B, K, Hv] with
        positions_first), as given.
      live_q: None or bool [B|1, N|1, T|1]: rows with a key to attend to.
    """
    out = uniform_where_no_key(
        out, value, live_q, head_major=head_major, positions_first=positions_first
    )
    if not return_residual:
        return out
    if live_q is not None:
        keys = value.shape[2 if head_major else 0 if positions_first else 1]
        lse = jnp.where(live_q, lse, jnp.asarray(MASK_VALUE + math.log(keys), lse.dtype))
    return out, lse
