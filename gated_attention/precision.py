"""The compute-dtype policy: which float dtype attention runs in for a given input dtype.

CPUs have no bfloat16/float16 arithmetic: XLA:CPU converts such operands around every dot and
elementwise op, so computing in them is slower than float32 and less accurate. Under the default
policy, 'auto', low-precision inputs are therefore computed in float32 when the default backend is
the CPU (outputs keep the input dtype); on GPU and TPU they are computed as given. scripts/benchmark.py
shows the effect (the bfloat16 rows against AF2's formulation, which computes in bfloat16).

Policies (global_config.compute_dtype, AttentionOptions.compute_dtype):
  'auto': float32 for bfloat16/float16 inputs on CPU, the input dtype otherwise.
  'input': always the input dtype (AlphaFold 2's behaviour).
  'float32': float32 for bfloat16/float16 inputs on every backend.
float32 and float64 inputs are always computed as given. Logits and softmax accumulate in float32
(float64 for float64 inputs) under every policy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

POLICIES = ("auto", "input", "float32")

_LOW_PRECISION = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def check_policy(name: str, policy) -> None:
    """Raises ValueError naming `name` unless policy is one of POLICIES."""
    if policy not in POLICIES:
        raise ValueError(f"{name} must be one of {POLICIES}, got {policy!r}")


def compute_dtype(dtype, policy: str = "auto", backend: str | None = None) -> jnp.dtype:
    """The dtype to compute in for inputs of `dtype` under `policy` on `backend`.

    Args:
      dtype: the inputs' float dtype.
      policy: one of POLICIES.
      backend: platform name; None: jax.default_backend().

    Returns:
      float32 for a bfloat16/float16 dtype when the policy asks for it ('float32', or 'auto' on
      CPU), else dtype itself.
    """
    check_policy("compute_dtype", policy)
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
