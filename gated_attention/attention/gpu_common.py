"""The rules both GPU kernel families follow (the Triton kernel, pallas_triton/, and the Mosaic GPU
kernel, pallas_mosaic_gpu/), owned by neither: either family can be removed without the other losing
them. The float32 dots' precision, whether a call asks for the kernels' further arguments, how
many batch rows share one program of the shared bias's gradient, the backward's delta and the
bias gradients' last sums, and the softmax's base-2 constants.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

LOG2E = 1.4426950408889634  # exp(x) = exp2(x * LOG2E): one MUFU.EX2, no range reduction
# The masked logit in the kernels: a power of two near numerics.MASK_VALUE, so that on a row
# masked so far the fused s * LOG2E - m * LOG2E is exactly 0 (for -1e9 it is up to +-64, weights
# of 2**64). Never seen: a row with no key gets MASK_VALUE's from finish_rows_without_key.
MASKED = -(2.0**30)

# jax_default_matmul_precision's names -> the three levels of lax.Precision.
_PRECISION_NAMES = {
    "default": "default",
    "fastest": "default",
    "bfloat16": "default",
    "high": "high",
    "tensorfloat32": "high",
    "bfloat16_3x": "high",
    "highest": "highest",
    "float32": "highest",
}


def dot_precision(precision, compute_dtype, interpret: bool):
    """The float32 dots' precision, as XLA's own float32 dots on a GPU follow JAX's: the call's
    `precision`, else jax_default_matmul_precision, else DEFAULT. DEFAULT is one TF32 pass on the
    tensor cores (about 1e-3 relative error, what AF2's einsums get on a GPU), HIGH three TF32
    passes (near float32), HIGHEST IEEE float32 (scalar FMAs: slow). Half precision: None. In the
    interpreter (on CPU, where there is no TF32) every level computes in float32."""
    if jnp.dtype(compute_dtype) != jnp.float32:
        return None
    if precision is None:
        precision = jax.config.jax_default_matmul_precision
    if isinstance(precision, tuple):
        precision = max(precision, key=lambda p: p.value)
    if isinstance(precision, lax.Precision):
        level = precision.name.lower()
    else:
        level = _PRECISION_NAMES.get(str(precision).lower(), "highest") if precision else "default"
    if level == "highest" or interpret:
        return lax.Precision.HIGHEST
    if level == "high":
        return lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    return lax.Precision.DEFAULT


def extra_options(options, query, key) -> bool:
    """Whether the call asks for more than plain attention in the kernels' registers (the
    residual and precision cost none)."""
    return bool(options.asked(query, key).keys() - {"precision", "return_residual"})


def bias_grad_groups(batch: int, heads: int, q_blocks: int, biases, programs: int) -> int:
    """Groups of batch rows the dq / bias-gradient kernel splits a bias shared over the batch
    into (each group's program owns its float32 tiles: deterministic, no atomics): enough that
    about `programs` programs run, one group per row at most; the batch when no bias is shared."""
    if not any(b.shape[0] == 1 for b in biases) or batch == 1:
        return batch
    programs_per_row = heads * q_blocks
    return min(batch, max(1, -(-programs // programs_per_row)))


def softmax_delta(out, d_out, d_lse, positions_first: bool = False):
    """[B, N, T] float32: rowsum(dO * O) - d_lse, the softmax backward's correction (d lse /
    d logits = p, so ds = p * (dp - delta)); out and d_out [B, T, N, H] ([T, B, N, H])."""
    spec = "tbnh,tbnh->bnt" if positions_first else "btnh,btnh->bnt"
    delta = jnp.einsum(spec, out.astype(jnp.float32), d_out.astype(jnp.float32))
    return delta - d_lse.astype(jnp.float32)


def sum_bias_partials(biases, partials) -> tuple:
    """Each bias's gradient from its float32 partials (per batch row or row group, per query
    block for a bias without a query axis): summed over the axes the bias broadcasts, in its
    dtype."""
    dbiases = []
    for bias, partial in zip(biases, partials, strict=True):
        axes = tuple(a for a in range(4) if bias.shape[a] == 1 and partial.shape[a] > 1)
        dbiases.append(jnp.sum(partial, axis=axes, keepdims=True).astype(bias.dtype))
    return tuple(dbiases)
