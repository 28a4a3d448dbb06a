"""A fused attention kernel for TPUs in Pallas (Mosaic lowering), biases shared over the batch included.

The arrays stay in the public layout: q [B, T, N*H], k and v [B, S, N*H] are free reshapes of
[B, T, N, H], so every block is a lane-dense [rows, N*H] tile (a [.., N, H] block would put the
heads on the sublanes, which Mosaic does not take, and a head-major copy would double the inputs).
Each program handles all N heads of its rows, slicing a head's H lanes inside the tile: head dims
of 8 to 128 are padded to the lanes inside the kernel, never in HBM.

Forward: grid (batch row, query block, key block), keys innermost ('arbitrary'): an online softmax
(FlashAttention-2) in VMEM scratch, the log-sum-exp of each query saved as [B, N, T]. Every bias
and the mask are read tile by tile through their own broadcast dimensions (a [1, N, T, S] bias is
read in place by every batch row, a key mask is never expanded to [B, N, T, S]).

Backward, three kernels, no atomics, so every gradient is deterministic:
  * dk, dv: grid (row, key block, query block);
  * dq: grid (row, query block, key block);
  * the bias gradients: grid (query block, key block, row), rows innermost, so the tile of a
    bias shared over the batch stays in VMEM and is summed over the rows in place: O(N·T·S), no
    [B, N, T, S] array. A per-row bias's tile is written once per row.
Recomputing the logits in the third kernel costs two more dots per tile; in exchange no kernel
keeps more than a few tiles in VMEM at any crop.

Numerics follow numerics.py (as attention/pallas_triton/implementation.py): float32 logits, softmax and accumulation; masked logits
selected to MASK_VALUE; queries with no key and keys no query sees zeroed as loaded (so masked
garbage never leaks); rows past the end of a partial block zeroed; fully masked rows get the
uniform average of the values as given (outside the kernel). Per-row vectors (log-sum-exp, delta,
liveness) are stored lane-dense [.., L] and turned into columns inside the kernel by a masked lane
sum (`_column`), which Mosaic lowers for any length (no transposes of odd shapes).

jax.nn's and tokamax's further arguments (base.Options), inside the tiles: grouped-query attention
reads key/value head n // group for query head n (k, v and their gradients are [B, S, K*H]; the
query heads of a group sum into one dk/dv accumulator); the causal, window and length masks are
compared from iotas and a per-row int32 vector in SMEM (first query's position, lengths), and a
tile they mask whole is skipped in the forward, dk/dv and dq kernels (a causal forward does about
half the work); the soft cap is applied after the biases and its derivative taken in the
backward; the log-sum-exp is the residual (no gradient).

Files: this one, the implementation (check, __call__) and the kernels' custom VJP;
attention/pallas_mosaic_tpu/plan.py, the static facts of a call (Plan: tiles, VMEM estimate, BlockSpecs);
attention/pallas_mosaic_tpu/kernels.py, the kernel bodies and their launches.

`interpret=True` runs the kernels in Pallas's interpreter on any backend, `interpret="tpu"` in its
TPU interpreter, which also models TPU memory (how they are tested on CPU). Without it they run on
TPU only (check() says so elsewhere).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from gated_attention.attention import base
from gated_attention.attention.pallas_mosaic_tpu import kernels as pallas_tpu_kernels
from gated_attention.attention.pallas_mosaic_tpu.plan import Plan
from gated_attention.core import checks, memory, numerics

DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
MAX_HEAD_DIM = 128
LANES = memory.TPU_LANES  # blocks are whole multiples of a vector register's lanes
# The default scoped VMEM of a TPU v5e (the smallest of v5e, v5p, v6e): check() refuses tiles whose
# estimate exceeds it rather than let Mosaic fail to compile.
VMEM_LIMIT = 16 * 2**20


@dataclasses.dataclass(frozen=True)
class PallasTpuAttention(base.Implementation):
    """Fused attention in Pallas/Mosaic for TPUs, with per-bias broadcast and a deterministic bias
    gradient (module docstring).

    Attributes:
      block_q: queries per tile (a multiple of 128; a shorter sequence is one whole tile).
      block_k: keys per tile (likewise).
      interpret: run the kernels in an interpreter on any backend (for tests): True, Pallas's
        generic one (fast); "tpu", Pallas's TPU interpreter, which also models TPU memory
        (scratch starts as NaN, DMAs complete on wait) and is several times slower.
    """

    name = "pallas_tpu"
    block_q: int = 128
    block_k: int = 128
    interpret: bool | str = False

    TAKES = base.ALL_OPTIONS

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            value = checks.check_int(name, getattr(self, name), minimum=LANES)
            if value % LANES:
                raise ValueError(f"{name} must be a multiple of {LANES}, got {value}")
        if not (isinstance(self.interpret, bool) or self.interpret == "tpu"):
            raise ValueError(f"interpret must be a bool or 'tpu', got {self.interpret!r}")

    def plan(
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
        platform=None,
    ) -> Plan:
        self.refuse_options(query, key, options)
        base.check_kernel(
            "the Pallas TPU kernel",
            "tpu",
            impl=self,
            platform=platform,
            compute_dtype=compute_dtype,
            dtypes=DTYPES,
            query=query,
            value=value,
            max_head_dim=MAX_HEAD_DIM,
        )
        plan = self._make(query, key, value, biases, mask, scale, compute_dtype, options)
        need = plan.vmem_estimate(jnp.dtype(query.dtype).itemsize)
        if need > VMEM_LIMIT:
            raise NotImplementedError(
                f"tiles of {plan.block_q} x {plan.block_k} over {plan.heads} heads need about "
                f"{need:,} bytes of VMEM, over the {VMEM_LIMIT:,} a TPU v5e's kernels get: "
                "take smaller blocks"
            )
        return plan

    def _make(self, query, key, value, biases, mask, scale, compute_dtype, options) -> Plan:
        live_q, live_k = base.live_shapes(options.structure, mask, query.shape[1], key.shape[1])
        return Plan.make(
            self, query, key, value, biases, mask, scale, compute_dtype, options, live_q, live_k
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
        batch, q_len, heads, head_dim = query.shape
        k_len, kv_heads, value_dim = key.shape[1], key.shape[2], value.shape[-1]
        structure = options.structure
        # Live queries [B|1, N|1, T|1] and keys [B|1, N|1, S|1] under the mask and the structure.
        live_q, live_k = structure.live(mask, q_len, k_len)
        extras = []
        if mask is not None:
            extras.append(mask.astype(jnp.int8))  # int8 tiles for Mosaic
        if live_q is not None:
            extras += [live_q.astype(jnp.float32), live_k.astype(jnp.float32)]
        if not structure.trivial:
            extras.append(structure.meta(batch).reshape(-1))  # 1-D in SMEM
        if plan is None:
            plan = self._make(query, key, value, biases, mask, scale, compute_dtype, options)
        out, lse = _attention(
            plan,
            query.reshape(batch, q_len, heads * head_dim),
            key.reshape(batch, k_len, kv_heads * head_dim),
            value.reshape(batch, k_len, kv_heads * value_dim),
            tuple(biases),
            tuple(extras),
        )
        out = out.reshape(batch, q_len, heads, value_dim)
        return numerics.finish_rows_without_key(out, lse, value, live_q, options.return_residual)


_attention = base.kernel_attention(pallas_tpu_kernels.forward, pallas_tpu_kernels.backward)
