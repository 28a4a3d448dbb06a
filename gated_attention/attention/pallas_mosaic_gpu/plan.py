"""The static facts of one call of the Mosaic GPU kernels (attention/pallas_mosaic_gpu/implementation.py), and the few operations whose
Mosaic GPU form JAX's Mosaic GPU interpreter cannot run (the `Ops` of a plan).

Plan is hashable (the custom VJP's static argument): tiles, padded sizes, the broadcast form of
each bias and of the mask, the options the kernels apply. `launch` is plgpu.kernel with a
producer warpgroup (TMA loads) and one or two consumer warpgroups (wgmma and the softmax).

The interpreter (jax 0.10.2 and 0.12) runs TMA copies, barriers, threads and loops, but not
`plgpu.load` with a register layout, layout casts, `broadcasted_iota` with a layout, nor wgmma
with a transposed operand or an operand in registers. `Ops` gives those four in both forms: the
wgmma / layout form compiled for a GPU, a plain jnp form in the interpreter (float32 dots at
HIGHEST there, as the interpreter has no TF32).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math

import jax.numpy as jnp
from jax import lax

from gated_attention.attention import base
from gated_attention.attention.gpu_common import bias_grad_groups, extra_options
from gated_attention.core import compat, platforms

Q, K, V = 0, 1, 2  # the slots of a packed q/k/v array (Plan.packed)
DEPTH = 2  # pipeline slots: the producer loads step t + 1 while the consumer computes step t
# Warpgroups of an interpreted kernel. Two (producer and consumer, as compiled) run in the
# interpreter only where its kernel is the whole program (eager): inside a larger jitted program
# the interpreter's nested callbacks wait on each other for XLA:CPU's pool threads, and with 2
# cores they deadlock. One warpgroup issues each step's copies and waits on them itself.
INTERPRET_WARPGROUPS = 1


def modules():
    """(jax.experimental.pallas, its mosaic_gpu module): already imported by `import
    gated_attention` (compat.import_pallas); a jax without it raises ImportError here."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return pl, plgpu


def interpret_params():
    """The Mosaic GPU interpreter's parameters (public from jax 0.11 on, private before)."""
    _, plgpu = modules()
    return compat.mosaic_gpu_interpret_params(plgpu)()


def pad_to(n: int, block: int) -> int:
    return -(-n // block) * block


def feature_pad(dim: int, itemsize: int) -> int:
    """A head dim padded for wgmma: a multiple of 16 bytes' worth of K, a power of two up to the
    128-byte swizzle (8 -> 16 for 16-bit types), then multiples of it."""
    unit = 128 // itemsize  # elements in one 128-byte swizzle row
    if dim >= unit:
        return pad_to(dim, unit)
    return max(16 // itemsize * 2 if itemsize == 4 else 16, 1 << max(0, dim - 1).bit_length())


def broadcast_form(shape) -> str:
    """How a [B|1, N|1, T|1, S|1] bias or mask reaches a [block_q, block_k] tile: 'tile' (T and
    S), 'keys' (S only: one vector over the keys), 'queries' (T only)."""
    if shape[2] > 1 and shape[3] > 1:
        return "tile"
    return "keys" if shape[3] > 1 else "queries"


@dataclasses.dataclass(frozen=True)
class Plan(base.KernelPlan):
    """Static facts of one call, shared by the three kernels."""

    block_q: int
    block_k: int
    q_len: int  # before padding: keys at or past k_len are -inf, rows past q_len are sliced off
    k_len: int
    q_pad: int
    k_pad: int
    head_dim: int  # padded (feature_pad)
    value_dim: int
    bias_shapes: tuple  # each bias's [B|1, N|1, T|1, S|1] after padding
    bias_dtypes: tuple  # their dtype names
    mask_shape: tuple | None
    live: bool  # int32 live-query and live-key vectors, dead rows zeroed in shared memory
    row_groups: int  # batch-row groups of the dq/bias-gradient kernel (attention/pallas_triton/implementation.py's scheme)
    warpgroups: int = 2  # 2: a producer and a consumer; 1: one does both (interpreter only)
    # Positions first (Options.positions_first): q, k, v, out and their gradients [L, B, N, D],
    # each tile copied in place along the batch's columns (rows) by the TMA.
    columns: bool = False
    # Packed (Options.packed): q, k and v are slots 0, 1, 2 of one [B, L, 3, N, D] array ([L, B,
    # 3, N, D] with columns), each tile copied from its slot in place.
    packed: bool = False
    # Batch rows of one forward program (MosaicAttention.rows_per_program): they read the tiles
    # of a bias (and mask) shared over the batch once a key block.
    rows_per_program: int = 1
    # Consumer warpgroups of a forward program (MosaicAttention.consumer_warpgroups): each owns
    # block_q query rows of the program's consumer_warpgroups * block_q, all read the same K/V
    # slots. The backward kernels run on with_one_consumer() (one consumer, as before).
    consumer_warpgroups: int = 1
    # Programs of a persistent forward (MosaicAttention.persistent; 0: one program a tile, the
    # grid of tiles): program t computes tiles t, t + programs, ... (persistent_programs).
    programs: int = 0

    def tiles(self, batch: int) -> tuple[int, int, int]:
        """The forward's tiles (row groups, heads, query spans): groups of rows_per_program batch
        rows, spans of consumer_warpgroups query blocks, the last of each clamped (_parts)."""
        groups = -(-batch // self.rows_per_program)
        return groups, self.heads, -(-self.q_blocks // self.consumer_warpgroups)

    @property
    def parts(self) -> int:
        """The (batch row, query block) parts of one forward program: its rows or consumers."""
        return self.rows_per_program * self.consumer_warpgroups

    def own_tiles(self, shape) -> bool:
        """Whether each part of a forward program needs its own tiles of a [B|1, N|1, T|1, S|1]
        array: its rows differ in B, its consumers in T; else one tile serves them all."""
        return (self.rows_per_program > 1 and shape[0] > 1) or (
            self.consumer_warpgroups > 1 and shape[2] > 1
        )

    @property
    def threads(self) -> int:
        """Warpgroups a program runs: the consumers and a producer; 1 alone (interpreter)."""
        return 1 if self.warpgroups == 1 else self.consumer_warpgroups + 1

    def with_one_consumer(self) -> Plan:
        return dataclasses.replace(self, consumer_warpgroups=1)

    def rows(self, ref, b, span, n, slot: int | None = None):
        """ref [B, L, N, D] ([L, B, N, D] with columns) at batch row b, rows span, head n; `slot`
        of a packed [B, L, 3, N, D] ref (Plan.packed: q 0, k 1, v 2; None for the others)."""
        rows = (span, b) if self.columns else (b, span)
        slots = (slot,) if self.packed and slot is not None else ()
        return ref.at[(*rows, *slots, n)]

    @property
    def q_blocks(self) -> int:
        return self.q_pad // self.block_q

    @property
    def k_blocks(self) -> int:
        return self.k_pad // self.block_k

    @property
    def tf32(self) -> bool:
        """float32 dots: TF32 wgmma, which takes both operands K-major only, so the kernels read
        transposed copies of the operands they contract over their rows (mosaic_kernels)."""
        return jnp.dtype(self.compute_dtype) == jnp.float32

    @property
    def mask_dtype(self):
        """int8 tiles; int32 vectors (a copy moves a multiple of 128 bytes: 64 int8 keys do not)."""
        return jnp.int8 if broadcast_form(self.mask_shape) == "tile" else jnp.int32

    @property
    def ops(self) -> Ops:
        return Ops(self.interpret)

    def launch(self, kernel, grid, names, out_type, scratch, args, name: str):
        """plgpu.kernel over `grid` (axes `names`) with its warpgroups, axis 'wg': 0 ..
        consumer_warpgroups - 1 compute, the last loads; `name` names the kernel (ptxas reports
        it)."""
        _, plgpu = modules()
        body = functools.partial(kernel, plan=self)
        body.__name__ = name
        return plgpu.kernel(
            body,
            out_type=out_type,
            scratch_types=scratch,
            grid=grid,
            grid_names=names,
            num_threads=self.threads,
            thread_name="wg",
            # ex2.approx.ftz for exp2 (no subnormal fix-up: 3 instructions a score); its tanh
            # would be approx too (2**-11), so a soft cap keeps the exact functions.
            compiler_params=plgpu.CompilerParams(approx_math=self.soft_cap is None),
            interpret=interpret_params() if self.interpret else None,
        )(*args)

    def smem(self, shape, dtype, operand: bool = False):
        """A shared-memory buffer; `operand`: a wgmma operand, tiled and swizzled for it."""
        _, plgpu = modules()
        dtype = jnp.dtype(dtype)
        if not operand:
            return plgpu.SMEM(tuple(shape), dtype)
        swizzle = min(128, shape[-1] * dtype.itemsize)
        transforms = (
            plgpu.TilingTransform((8, swizzle // dtype.itemsize)),
            plgpu.SwizzleTransform(swizzle),
        )
        return plgpu.SMEM(tuple(shape), dtype, transforms=transforms)

    @classmethod
    def make(cls, impl, query, key, value, biases, mask, scale, compute_dtype, options, live=False):
        batch, q_len, heads, head_dim = query.shape
        k_len = key.shape[1]
        itemsize = jnp.dtype(compute_dtype).itemsize
        extra = extra_options(options, query, key)
        block_q, block_k = impl.tiles(compute_dtype, max(head_dim, value.shape[-1]), extra)
        q_pad, k_pad = pad_to(q_len, block_q), pad_to(k_len, block_k)

        def padded(shape):
            return (
                shape[0],
                shape[1],
                q_pad if shape[2] > 1 else 1,
                k_pad if shape[3] > 1 or shape[2] == 1 else 1,  # [.., 1, 1] is given S
            )

        groups = bias_grad_groups(batch, heads, q_pad // block_q, biases, impl.bias_grad_programs)
        # Several rows a program only where a bias is shared and every row walks the same key
        # blocks (no structure) with the same heads (Triton's Plan.make rule).
        shared = any(b.shape[0] == 1 for b in biases)
        per = impl.rows_per_program or 1
        per = per if shared and not extra else 1
        consumers = check_consumers(impl.consumer_warpgroups, impl.rows_per_program)
        per = max(1, min(per, batch))
        plan = cls(
            **base.KernelPlan.shared(impl, query, key, scale, compute_dtype, options),
            block_q=block_q,
            block_k=block_k,
            q_len=q_len,
            k_len=k_len,
            q_pad=q_pad,
            k_pad=k_pad,
            head_dim=feature_pad(head_dim, itemsize),
            value_dim=feature_pad(value.shape[-1], itemsize),
            bias_shapes=tuple(padded(b.shape) for b in biases),
            bias_dtypes=tuple(jnp.dtype(b.dtype).name for b in biases),
            mask_shape=None if mask is None else padded(mask.shape),
            live=bool(live) and jnp.dtype(compute_dtype) != jnp.float32,
            row_groups=groups,
            warpgroups=INTERPRET_WARPGROUPS if impl.interpret else 2,
            columns=options.positions_first,
            packed=options.packed,
            rows_per_program=per,
            consumer_warpgroups=consumers,
        )
        tiles = math.prod(plan.tiles(batch))
        return dataclasses.replace(plan, programs=persistent_programs(impl.persistent, tiles))


def check_consumers(consumers, rows) -> int:
    """MosaicAttention.consumer_warpgroups, refused where the forward cannot run it."""
    if isinstance(consumers, bool) or consumers not in (1, 2):
        raise ValueError(f"consumer_warpgroups must be 1 or 2, got {consumers!r}")
    if consumers == 2 and (rows or 1) > 1:
        raise ValueError(
            f"consumer_warpgroups=2 takes rows_per_program None or 1 (one batch row a program, "
            f"two query blocks), got rows_per_program={rows}"
        )
    return consumers


def persistent_programs(persistent: bool, tiles: int) -> int:
    """Programs of the forward: 0 (one a tile) unless persistent, else one per streaming
    multiprocessor of the GPU compiled for (platforms.gpu_core_count), at most one a tile."""
    return min(platforms.gpu_core_count(), tiles) if persistent else 0


@functools.cache
def _load_takes_an_index() -> bool:
    """plgpu.load(ref, idx, ...) before jax 0.12, plgpu.load(ref, ...) from it on."""
    _, plgpu = modules()
    return "idx" in inspect.signature(plgpu.load).parameters


@dataclasses.dataclass(frozen=True)
class Ops:
    """The operations with a compiled (wgmma, register layouts) and an interpreted form."""

    interpret: bool

    def zeros(self, shape, axis: int | None = None, fill=0.0):
        """float32 `shape` filled: in the wgmma accumulator layout (a vector: that layout less
        `axis`, the reduced one)."""
        x = jnp.full(shape, fill, jnp.float32)
        if self.interpret:
            return x
        _, plgpu = modules()
        layout = plgpu.Layout.WGMMA if axis is None else plgpu.Layout.WGMMA.reduce(axis)
        return plgpu.layout_cast(x, layout)

    def load(self, ref, axis: int | None = None):
        """A shared-memory tile into registers in the accumulator's layout (a vector: less the
        reduced `axis`)."""
        if self.interpret:
            return ref[...]
        _, plgpu = modules()
        layout = plgpu.Layout.WGMMA if axis is None else plgpu.Layout.WGMMA.reduce(axis)
        index = ((),) if _load_takes_an_index() else ()
        return plgpu.load(ref, *index, layout=layout, optimized=False)

    def iota(self, shape, dimension: int):
        if self.interpret:
            return lax.broadcasted_iota(jnp.int32, shape, dimension)
        _, plgpu = modules()
        return plgpu.broadcasted_iota(jnp.int32, shape, dimension, layout=plgpu.Layout.WGMMA)

    def dot(self, a, b, *, trans_b: bool = False, acc=None, issued=None):
        """acc + a @ b (b.T with trans_b) in float32: `a` a shared-memory ref or registers, `b`
        a shared-memory ref; acc None: from zero. issued(): run once the wgmma is issued, before
        its result is awaited (compiled only)."""
        if self.interpret:
            bv = b[...]
            out = jnp.dot(
                a[...], bv.T if trans_b else bv, preferred_element_type=jnp.float32,
                precision=lax.Precision.HIGHEST,
            )  # fmt: skip
            return out if acc is None else acc + out
        pl, plgpu = modules()
        rhs = plgpu.transpose_ref(b, (1, 0)) if trans_b else b

        def step(acc_ref):
            plgpu.wgmma(acc_ref, a, rhs)
            if issued is not None:
                issued()

        if acc is None:
            shape = (a.shape[0], b.shape[0] if trans_b else b.shape[1])

            def fresh(acc_ref):
                step(acc_ref)
                return acc_ref[...]

            return pl.run_scoped(fresh, plgpu.ACC(shape, jnp.float32))
        return pl.run_state(step)(plgpu.ACC.init(acc))
