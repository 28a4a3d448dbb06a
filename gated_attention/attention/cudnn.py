"""cuDNN flash attention through jax.nn.dot_product_attention(implementation='cudnn').

jax.nn takes the public layout [B, T, N, H] as it comes. What the adapter adds so that cuDNN meets
this library's contract (numerics.py):

* bias and mask: cuDNN wants rank-4 tensors whose two sequence dimensions are full ([*, *, T, S]);
  size-1 sequence dimensions are broadcast (batch and head dimensions stay shared), the biases are
  summed and cast to the input dtype (cuDNN's requirement), and jax.nn folds the mask into them;
* masked positions are zeroed first (numerics.zero_dead_inputs), so they never leak;
* fully masked rows: cuDNN's result there is not specified, so rows with no key to attend to are set
  to the uniform average over the keys, exactly what the dense implementation gives;
* jax.nn's own arguments carry the structured masks (is_causal, the sequence lengths, the window:
  cuDNN takes a left window only, or any window when causal), grouped-query attention and the
  residual (which cuDNN returns in the input dtype; it is cast to float32);
* what it cannot take (not GPU, float32/float64, head dims not a multiple of 8 or above 128, value
  head dim different from the key head dim, a soft cap, a precision, a window reaching right of a
  non-causal query) raises NotImplementedError from `check`.

`CudnnAttention(jax_nn_implementation='xla')` runs the same adaptation through jax.nn's XLA path on
any backend: how the adaptation is tested on machines without a GPU.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gated_attention.attention import base
from gated_attention.core import checks, compat, numerics, platforms

CUDNN_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
MAX_HEAD_DIM = 128  # 256 on Hopper and later; 128 holds on every GPU cuDNN flash attention runs on


@dataclasses.dataclass(frozen=True)
class CudnnAttention(base.Implementation):
    """jax.nn.dot_product_attention with cuDNN, adapted to this library's contract.

    Attributes:
      jax_nn_implementation: jax.nn's implementation to run ('cudnn'; 'xla' runs the adaptation
        anywhere, for tests).
    """

    name = "cudnn"
    TAKES = frozenset(
        (
            "grouped",
            "is_causal",
            "local_window_size",
            "query_seq_lengths",
            "key_value_seq_lengths",
            "return_residual",
        )
    )
    jax_nn_implementation: str = "cudnn"

    @classmethod
    def candidates(
        cls, capability, dtype, head_dim: int, *, bias: str = "shared", mask: str = "key"
    ) -> list[dict]:
        """The instance as it is, where cuDNN takes the dtype and head dim (check()); else none."""
        del capability, bias, mask
        takes = jnp.dtype(dtype) in CUDNN_DTYPES and head_dim % 8 == 0 and head_dim <= MAX_HEAD_DIM
        return [{}] if takes else []

    def __post_init__(self):
        checks.check_one_of("jax_nn_implementation", self.jax_nn_implementation, ("cudnn", "xla"))

    def check(
        self, query, key, value, biases, mask, *, compute_dtype, options=base.PLAIN, platform=None
    ):
        super().check(query, key, value, biases, mask, compute_dtype=compute_dtype, options=options)
        if value.shape[-1] != query.shape[-1]:
            raise NotImplementedError(
                "jax.nn.dot_product_attention needs equal key and value head dims, got "
                f"{query.shape[-1]} and {value.shape[-1]}"
            )
        if self.jax_nn_implementation != "cudnn":
            return
        structure = options.structure
        if structure.window is not None and structure.window[1] and not structure.is_causal:
            raise NotImplementedError(
                f"cuDNN's sliding window reaches no key right of the query unless causal, got "
                f"local_window_size={structure.window}"
            )
        platform = platforms.host() if platform is None else platform
        if platform != "gpu":
            raise NotImplementedError(
                f"cuDNN attention runs on GPU only, the program is for {platform!r}"
            )
        q_len, kv_len = query.shape[1], key.shape[1]
        if biases and (q_len % 2 or kv_len % 2):  # jax.nn's cuDNN backward refuses them
            raise NotImplementedError(
                f"cuDNN attention with a bias needs even sequence lengths (its training step "
                f"refuses odd ones), got T={q_len}, S={kv_len}"
            )
        dtype, head_dim = jnp.dtype(compute_dtype), query.shape[-1]
        if dtype not in CUDNN_DTYPES:
            raise NotImplementedError(f"cuDNN attention takes float16 or bfloat16, got {dtype}")
        if head_dim % 8 or head_dim > MAX_HEAD_DIM:
            raise NotImplementedError(
                f"cuDNN needs a head dim that is a multiple of 8 and <= {MAX_HEAD_DIM}, got "
                f"{head_dim}"
            )
        if compat.cudnn_version() is None:
            raise NotImplementedError(
                "cuDNN attention needs the cuDNN library, which JAX cannot load here"
            )

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
        q_len, kv_len = query.shape[1], key.shape[1]
        full = lambda x: jnp.broadcast_to(x, (*x.shape[:2], q_len, kv_len))  # cuDNN: [*, *, T, S]
        q, k, v = (x.astype(compute_dtype) for x in (query, key, value))
        bias = None
        for b in biases:
            bias = b if bias is None else bias + b
        if bias is not None:
            bias = full(bias.astype(compute_dtype))
        structure = options.structure
        live_q, live_k = structure.live(mask, q_len, kv_len)  # [B|1, N|1, T], [B|1, N|1, S]
        out = jax.nn.dot_product_attention(
            *numerics.zero_dead_inputs(q, k, v, live_q, live_k, head_major=False),
            bias,
            None if mask is None else full(mask),
            scale=scale,
            is_causal=structure.is_causal,
            query_seq_lengths=structure.q_lengths,
            key_value_seq_lengths=structure.kv_lengths,
            local_window_size=structure.window,
            implementation=self.jax_nn_implementation,
            return_residual=options.return_residual,
        )  # [B, T, N, Hv] (and [B, T, N])
        out, lse = out if options.return_residual else (out, None)
        if lse is not None:
            lse = jnp.swapaxes(lse, 1, 2).astype(numerics.accumulation_dtype(compute_dtype))
        out = out.astype(query.dtype)
        return numerics.finish_rows_without_key(out, lse, v, live_q, options.return_residual)
