"""The static facts of one call of the Pallas TPU kernels (attention/pallas_mosaic_tpu/implementation.py): Plan, hashable (the
custom VJP's static argument), with the grid's block counts, the VMEM estimate check() compares
with the scoped VMEM (memory.tpu_vmem_bytes), the pallas_call launch and the BlockSpecs that tile
the arrays for the kernels of attention/pallas_mosaic_tpu/kernels.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from gated_attention.attention import base
from gated_attention.core import memory


def pallas_modules():
    """(jax.experimental.pallas, its tpu module): already imported by `import gated_attention`
    (compat.import_pallas); a jax without it raises ImportError here."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    return pl, pltpu


@dataclasses.dataclass(frozen=True)
class Plan(base.KernelPlan):
    """Static facts of one call, shared by the kernels (hashable: a custom_vjp argument)."""

    batch: int
    head_dim: int
    value_dim: int
    q_len: int
    k_len: int
    block_q: int
    block_k: int
    bias_shapes: tuple
    mask_shape: tuple | None
    live_shapes: tuple | None  # (live queries, live keys) shapes
    precision: Any

    @classmethod
    def make(
        cls,
        impl,
        query,
        key,
        value,
        biases,
        mask,
        scale,
        compute_dtype,
        options,
        live_q=None,
        live_k=None,
    ):
        batch, q_len, heads, head_dim = query.shape
        k_len = key.shape[1]
        live_shapes = None if live_q is None else (tuple(live_q.shape), tuple(live_k.shape))
        return cls(
            **base.KernelPlan.shared(impl, query, key, scale, compute_dtype, options),
            batch=batch,
            head_dim=head_dim,
            value_dim=value.shape[-1],
            q_len=q_len,
            k_len=k_len,
            block_q=impl.block_q if q_len > impl.block_q else q_len,
            block_k=impl.block_k if k_len > impl.block_k else k_len,
            bias_shapes=tuple(tuple(b.shape) for b in biases),
            mask_shape=None if mask is None else tuple(mask.shape),
            live_shapes=live_shapes,
            precision=options.precision,
        )

    @property
    def q_blocks(self) -> int:
        return -(-self.q_len // self.block_q)

    @property
    def k_blocks(self) -> int:
        return -(-self.k_len // self.block_k)

    def vmem_estimate(self, itemsize: int) -> int:
        """About the VMEM of the largest kernel (dk/dv) for these tiles, inputs of itemsize bytes:
        memory.tpu_vmem_bytes."""
        pairs = self.bias_shapes + ((self.mask_shape,) if self.mask_shape else ())
        return memory.tpu_vmem_bytes(
            block_q=self.block_q,
            block_k=self.block_k,
            heads=self.heads,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            value_dim=self.value_dim,
            itemsize=itemsize,
            pair_shapes=pairs,
        )

    def call(self, kernel, grid, in_specs, out_specs, out_shape, scratch, semantics, args, name):
        pl, pltpu = pallas_modules()
        return pl.pallas_call(
            kernel,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=0,
                grid=grid,
                in_specs=in_specs,
                out_specs=out_specs,
                scratch_shapes=scratch,
            ),
            out_shape=out_shape,
            compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
            interpret=pltpu.InterpretParams() if self.interpret == "tpu" else self.interpret,
            name=name,
        )(*args)

    # BlockSpecs. `order` names the grid axes ('b', 'i', 'j'), which differ by kernel.
    def rows_spec(self, order, axis: str, width: int):
        """A [B, L, width] array's [block, width] tile of row b at block `axis` ('i' or 'j')."""
        pl, _ = pallas_modules()
        block = self.block_q if axis == "i" else self.block_k
        pick = _picker(order)
        return pl.BlockSpec((None, block, width), lambda *g: (pick(g, "b"), pick(g, axis), 0))

    def vector_spec(self, order, shape, axis: str):
        """A [B|1, N|1, L|1] per-query ('i') or per-key ('j') vector's [N|1, block|1] tile."""
        pl, _ = pallas_modules()
        block = self.block_q if axis == "i" else self.block_k
        pick = _picker(order)
        b0, n0, l0 = shape
        return pl.BlockSpec(
            (None, n0, block if l0 > 1 else 1),
            lambda *g: (pick(g, "b") if b0 > 1 else 0, 0, pick(g, axis) if l0 > 1 else 0),
        )

    def pair_spec(self, order, shape):
        """A [B|1, N|1, T|1, S|1] bias or mask's [N|1, bq|1, bk|1] tile."""
        pl, _ = pallas_modules()
        pick = _picker(order)
        b0, n0, t0, s0 = shape
        return pl.BlockSpec(
            (None, n0, self.block_q if t0 > 1 else 1, self.block_k if s0 > 1 else 1),
            lambda *g: (
                pick(g, "b") if b0 > 1 else 0,
                0,
                pick(g, "i") if t0 > 1 else 0,
                pick(g, "j") if s0 > 1 else 0,
            ),
        )

    def common_specs(self, order, with_grads: bool):
        """Specs of (q, k, v[, do, lse, delta], *biases[, mask][, live_q, live_k][, meta])."""
        pl, pltpu = pallas_modules()
        kv = self.kv_heads
        specs = [self.rows_spec(order, "i", self.heads * self.head_dim)]
        specs.append(self.rows_spec(order, "j", kv * self.head_dim))
        specs.append(self.rows_spec(order, "j", kv * self.value_dim))
        if with_grads:
            per_query = (self.batch, self.heads, self.q_len)
            specs += [self.rows_spec(order, "i", self.heads * self.value_dim)]
            specs += [self.vector_spec(order, per_query, "i")] * 2
        specs += [self.pair_spec(order, s) for s in self.bias_shapes]
        if self.mask_shape:
            specs.append(self.pair_spec(order, self.mask_shape))
        if self.live_shapes:
            live_q, live_k = self.live_shapes
            specs += [self.vector_spec(order, live_q, "i"), self.vector_spec(order, live_k, "j")]
        if self.structured:
            specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
        return specs


def _picker(order: str):
    return lambda grid, axis: grid[order.index(axis)]
