"""The static facts of one call of the Pallas GPU kernels (attention/pallas_triton/implementation.py): Plan, hashable (the custom
VJP's static argument), with the tiles (pallas_tiles' table unless the implementation names
them), the batch-row groups of the dq/bias-gradient kernel, the options the kernels apply, and the
pallas_call launch of the kernels of attention/pallas_triton/kernels.py.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import jax
import jax.numpy as jnp

from gated_attention.attention import base
from gated_attention.attention.gpu_common import bias_grad_groups, extra_options
from gated_attention.attention.pallas_triton.tile_table import _pow2_tile, kernel_form
from gated_attention.core import compat, platforms


def pallas_modules():
    """(jax.experimental.pallas, its triton module): already imported by `import
    gated_attention` (compat.import_pallas); a jax without it raises ImportError here."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    return pl, plgpu


def triton_backend_missing() -> str | None:
    """None where this JAX has Pallas's Triton backend, else why not (it was deprecated in jax
    0.11.0 for Mosaic GPU and is to be removed): the Triton kernel is then refused with this
    reason, never an import error."""
    try:  # by module name: what sys.modules holds decides, as for a fresh import
        importlib.import_module("jax.experimental.pallas.triton")
        compat.triton_registration()
    except ImportError as e:
        return (
            f"Pallas's Triton backend is not in jax {jax.__version__} (deprecated in jax 0.11.0 "
            f"for Mosaic GPU): {e}"
        )
    return None


# The padded head dims up to which a half-precision forward program takes two batch rows by
# default. Trial compiles (test_kernel_compiles) spilled at head dim 64 (8 B: an A100, bfloat16,
# both bias forms, a full mask) and in float32 (12 B: an H100, 'high', head dim 8).
ROWS_HEAD_DIM = 32


@dataclasses.dataclass(frozen=True)
class Plan(base.KernelPlan):
    """Static facts of one call, shared by its kernels (hashable: a custom_vjp argument)."""

    block_q: int
    block_k: int
    head_dim: int
    value_dim: int
    row_groups: int  # batch-row groups of the dq/bias-gradient kernel
    rows_per_program: int  # batch rows of one forward program (they read a shared bias once)
    num_warps: int
    num_stages: int
    precision: Any
    has_mask: bool
    has_live: bool
    ptx: bool  # compiled for CUDA: the kernels' float32 math as single PTX instructions
    # Plain half-precision attention: the softmax in base 2, exp2 of one FFMA a score, and k
    # unzeroed in the forward. float32 keeps exp and separate roundings (with its three-pass and
    # IEEE dots the FFMA form spilled 4-20 B), as do the op's further arguments (Plan.make).
    base2: bool
    # Positions first (Options.positions_first): q, k, v, out and their gradients [L, B, N, D],
    # read and written in place along the batch's columns (AF2's column-wise modules).
    columns: bool = False
    # Packed (Options.packed): q, k and v are slots 0, 1, 2 of one [B, L, 3, N, D] array ([L, B,
    # 3, N, D] with columns), read in place; the backward writes dq, dk, dv into one such array.
    packed: bool = False
    # One backward kernel (PallasAttention.fused_backward, attention/pallas_triton/kernels_fused.py).
    fused_backward: bool = False

    @classmethod
    def make(
        cls,
        impl,  # a pallas.PallasAttention: its tiles()
        query,
        key,
        value,
        biases,
        scale,
        compute_dtype,
        precision,
        mask=None,
        live_q=None,
        options=base.PLAIN,
    ):
        batch, q_len, heads, head_dim = query.shape
        k_len, value_dim = key.shape[1], value.shape[-1]
        padded = max(_pow2_tile(head_dim), _pow2_tile(value_dim))
        extra = extra_options(options, query, key)
        form = kernel_form(biases, mask)
        tile_q, tile_k, num_warps, num_stages = impl.tiles(
            compute_dtype, precision, padded, extra, form
        )
        block_q = min(tile_q, _pow2_tile(q_len))
        q_blocks = -(-q_len // block_q)
        groups = bias_grad_groups(batch, heads, q_blocks, biases, impl.bias_grad_programs)
        shared = any(b.shape[0] == 1 for b in biases)
        # The fast paths (base2, two rows a program, k unzeroed) are for plain half-precision
        # attention, AF2's, on Hopper (and in the interpreter, which checks their math): with
        # the op's further arguments, or on an A100 (mma.sync), they spilled 4-44 B where
        # ee7da3e's kernels did not (benchmark_results/gpu_kernels/base2).
        hopper = impl.interpret or platforms.gpu_is_hopper()
        plain = jnp.dtype(compute_dtype).itemsize == 2 and not extra and hopper
        per = impl.rows_per_program or (2 if plain and padded <= ROWS_HEAD_DIM else 1)
        per = per if shared and not extra else 1
        return cls(
            **base.KernelPlan.shared(impl, query, key, scale, compute_dtype, options),
            block_q=block_q,
            block_k=min(tile_k, _pow2_tile(k_len)),
            head_dim=head_dim,
            value_dim=value_dim,
            row_groups=groups,
            rows_per_program=max(1, min(per, batch)),
            num_warps=num_warps,
            num_stages=num_stages,
            precision=precision,
            has_mask=mask is not None,
            has_live=live_q is not None,
            ptx=not impl.interpret and "rocm" not in compat.registered_backends(),
            base2=plain,
            columns=options.positions_first,
            packed=options.packed,
            fused_backward=impl.fused_backward,
        )

    def call(self, kernel, grid, out_shape, args, name, aliases=None):
        pl, plgpu = pallas_modules()
        return pl.pallas_call(
            kernel,
            grid=grid,
            out_shape=out_shape,
            input_output_aliases=aliases or {},
            compiler_params=plgpu.CompilerParams(
                num_warps=self.num_warps, num_stages=self.num_stages
            ),
            interpret=self.interpret,
            name=name,
        )(*args)
