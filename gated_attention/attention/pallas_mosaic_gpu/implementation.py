"""A fused attention kernel for Hopper GPUs (sm_90a) in Pallas's Mosaic GPU backend, the contract
of the Triton kernel (attention/pallas_triton/implementation.py) on the backend JAX keeps: biases shared over the batch read in
place, their gradient summed per group of batch rows without atomics.

Each kernel runs two warpgroups: a producer that streams tiles into shared memory with TMA (two
slots, so the next step's tiles load while the current one computes) and a consumer that
multiplies with wgmma (bfloat16 and float16; float32 as TF32 wgmma, JAX's default precision)
and does the online softmax in registers (attention/pallas_mosaic_gpu/kernels_sm90.py).
  * forward: one program per (batch row, head, block of 64 queries), looping over the key blocks
    some query of the block may attend (masking's rule: tiles the causal, window and length masks
    hide whole are never loaded); saves the log-sum-exp. With consumer_warpgroups=2, two blocks
    a program, a consumer warpgroup each, on the same key blocks (their union) and K/V slots.
    With persistent=True, one program per streaming multiprocessor looping over those tiles.
  * dk, dv: one program per (batch row, key/value head, key block), over the group's query heads
    and the query blocks, in the transposed orientation (k @ q.T) so that p.T and ds.T are the
    left operands in registers.
  * dq and the bias gradients: one program per (group of batch rows, head, query block), as
    attention/pallas_triton/implementation.py's: it owns its tiles of the float32 bias-gradient buffers (per batch row for a
    per-row bias, per group for a shared one) and adds each step's ds into them by a
    read-modify-write through shared memory, so no [B, N, T, S] array is written for a bias
    shared over the batch and the result is deterministic.

Inputs are prepared by XLA around the kernels: queries, keys and values are cast to the compute
dtype, queries and keys that the masks leave without a partner zeroed (masked garbage never
leaks), and everything padded to whole tiles (64 queries, block_k keys) and head dims wgmma
takes (a power of two from 16, then multiples of the 128-byte swizzle). So unlike the Triton
kernel this one copies query, key and value once (small beside the [N, T, S] pair arrays),
and a bias or mask is copied only when a length is not a whole number of tiles. TF32 wgmma reads
both operands K-major, so in float32 the kernels also read transposed copies of v (forward),
q, dO, k and of the full-tile biases and masks (backward); the dk/dv kernel reads transposed
copies of full-tile biases and masks in every dtype.

Files: this one, the implementation (check, tiles, __call__: the inputs' preparation);
attention/pallas_mosaic_gpu/plan.py, the static facts of a call (Plan) and the operations with an interpreted form
(Ops); attention/pallas_mosaic_gpu/pipeline.py, the pipeline and the tiles the kernels share; attention/pallas_mosaic_gpu/kernels_sm90_forward.py, the
forward kernel; attention/pallas_mosaic_gpu/kernels_sm90.py, the backward kernels; each with its scratch and launch.

`interpret=True` runs the same kernels in JAX's Mosaic GPU interpreter on any backend, with the
few operations it lacks replaced (mosaic_plan.Ops: wgmma, register layouts), how they are tested
without a GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from gated_attention.attention import base, gpu_common
from gated_attention.attention.pallas_mosaic_gpu.kernels_sm90 import backward, shared_memory_bytes
from gated_attention.attention.pallas_mosaic_gpu.kernels_sm90_forward import forward
from gated_attention.attention.pallas_mosaic_gpu.plan import Plan, check_consumers
from gated_attention.core import checks, numerics, platforms

DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_HEAD_DIM = 128
# With a mask or a structure the kernels zero dead rows in shared memory: at head dims above 64
# that spills registers on an H100 (benchmark_results/mosaic_kernels/h100.md).
MAX_HEAD_DIM_MASKED = 64
BLOCK_Q = 64  # one consumer warpgroup: wgmma's M
MAX_ROWS_PER_PROGRAM = 4  # each row's k, v (DEPTH slots) and q tiles are in shared memory
SHARED_MEMORY_LIMIT = 232_448  # an H100's opt-in shared memory per block (227 KiB)


@dataclasses.dataclass(frozen=True)
class MosaicAttention(base.Implementation):
    """Fused attention in Pallas's Mosaic GPU backend for Hopper, bias gradient deterministic.

    Attributes:
      block_k: keys per tile (64 or 128; None: 128 for half precision at head dims <= 32
        without the op's further arguments, else 64: the largest that compiled without spills
        for an H100, benchmark_results/mosaic_kernels/h100.md).
      bias_grad_programs: about how many programs the dq/bias-gradient kernel should have when a
        bias is shared over the batch; batch rows are grouped so that it does.
      rows_per_program: batch rows one forward program computes when a bias is shared over the
        batch (1 to 4): each key block's tile of that bias (and of a mask shared over the batch)
        is loaded into shared memory once for them all, the rows' own k and v tiles beside it
        (AF2's pair bias is the same for every MSA row). None: 1. Always 1 without such a bias
        or with the op's further arguments (a causal, window or length mask, whose key blocks
        differ from row to row; grouped heads; a soft cap). The backward is unchanged.
      consumer_warpgroups: compute warpgroups of one forward program (1 or 2). With 2 a program
        covers 2 x 64 query rows of one batch row and head, each warpgroup 64 of them, both
        reading the same k, v (and key-only bias and mask) tiles the one producer streams, their
        wgmma and softmax alternating (named barriers); a bias or mask with a query dim gets a
        tile per warpgroup. Not with rows_per_program > 1. The backward is unchanged.
      persistent: launch the forward as one program per streaming multiprocessor of the GPU
        (at most one per tile), each looping over the tiles t, t + programs, ... a grid would
        launch a program for, so its producer loads the next tile's k and v while the consumers
        finish the last one's output. False: one program a tile. The backward is unchanged.
      interpret: run the kernels in JAX's Mosaic GPU interpreter (any backend; slow, for tests).
    """

    name = "mosaic"
    block_k: int | None = None
    bias_grad_programs: int = 512
    rows_per_program: int | None = None
    consumer_warpgroups: int = 1
    persistent: bool = False
    interpret: bool = False

    # Reads [T, B, N, H] (Plan.columns) and packed q/k/v (Plan.packed) in place.
    TAKES = base.ALL_OPTIONS | {"positions_first", "packed"}
    CANDIDATE_FIELDS = dict(
        block_k="bk", rows_per_program="r", consumer_warpgroups="c", persistent="p"
    )

    @classmethod
    def candidates(
        cls, capability, dtype, head_dim: int, *, bias: str = "shared", mask: str = "key"
    ) -> list[dict]:
        """On Hopper (sm_90: wgmma) alone, one row a program: the default tiles first (tiles()),
        then with a bias shared over the batch two rows a program at those tiles where their
        shared memory fits, then the other of 64 and 128 keys a tile where 128 compiled without
        spills (half precision, head dims <= 32; in float32 twice the TF32 tiles' shared
        memory), then each of those tiles with two consumer warpgroups where their shared memory
        fits, last the persistent forward (p1) at the default tile with two consumers where
        they fit; none past the head dims plan() takes. The two-consumer and persistent ones
        name their field (c2, p1), the others keep their names (one consumer, a grid)."""
        if capability is None or capability[0] != platforms.HOPPER or head_dim > MAX_HEAD_DIM:
            return []
        if mask != "none" and head_dim > MAX_HEAD_DIM_MASKED:
            return []
        _, default = cls().tiles(dtype, head_dim)
        ok = jnp.dtype(dtype).itemsize == 2 and head_dim <= 32
        out = [dict(block_k=default, rows_per_program=1)]
        if bias in ("shared", "both") and _fits(dtype, head_dim, default, 2, bias, mask):
            out.append(dict(block_k=default, rows_per_program=2))
        other = 64 if default == 128 else 128
        tiles = [default] + ([other] if other == 64 or ok else [])
        out += [dict(block_k=other, rows_per_program=1)] if len(tiles) > 1 else []
        for bk in tiles:
            if _fits(dtype, head_dim, bk, 1, bias, mask, consumers=2):
                out.append(dict(block_k=bk, rows_per_program=1, consumer_warpgroups=2))
        if _fits(dtype, head_dim, default, 1, bias, mask, consumers=2):
            out.append(
                dict(block_k=default, rows_per_program=1, consumer_warpgroups=2, persistent=True)
            )
        return out

    def __post_init__(self):
        value = checks.check_int("block_k", self.block_k, minimum=64, optional=True)
        if value is not None and value not in (64, 128):
            raise ValueError(f"block_k must be 64 or 128, got {value}")
        checks.check_int("bias_grad_programs", self.bias_grad_programs)
        rows = checks.check_int("rows_per_program", self.rows_per_program, optional=True)
        if rows is not None and rows > MAX_ROWS_PER_PROGRAM:
            raise ValueError(
                f"rows_per_program must be None or an int in [1, {MAX_ROWS_PER_PROGRAM}], got {rows}"
            )
        check_consumers(self.consumer_warpgroups, rows)
        checks.check_bool("persistent", self.persistent)
        checks.check_bool("interpret", self.interpret)

    def tiles(self, compute_dtype, head_dim: int, options: bool = False) -> tuple[int, int]:
        """(block_q, block_k) for a compute dtype, the larger head dim and whether the op's
        further arguments (gpu_common.extra_options) are asked."""
        if self.block_k is not None:
            return BLOCK_Q, self.block_k
        half = jnp.dtype(compute_dtype).itemsize == 2
        return BLOCK_Q, 128 if half and head_dim <= 32 and not options else 64

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
        what = "the Mosaic GPU kernel"
        base.check_kernel(
            what,
            "gpu",
            impl=self,
            platform=platform,
            compute_dtype=compute_dtype,
            dtypes=DTYPES,
            query=query,
            value=value,
            max_head_dim=MAX_HEAD_DIM,
        )
        if not self.interpret:
            capability = platforms.gpu_capability()
            if capability is None or capability[0] != platforms.HOPPER:
                got = "unknown" if capability is None else f"sm_{capability[0]}{capability[1]}"
                raise NotImplementedError(
                    f"{what} uses Hopper's wgmma: sm_90 GPUs only, this one is {got}"
                )
        masked = mask is not None or not options.structure.trivial
        if masked and max(query.shape[-1], value.shape[-1]) > MAX_HEAD_DIM_MASKED:
            raise NotImplementedError(
                f"{what} takes head dims <= {MAX_HEAD_DIM_MASKED} with a mask or a causal, "
                f"window or length mask (above, the kernels spill registers), got {query.shape[-1]} and "
                f"{value.shape[-1]}"
            )
        if jnp.dtype(compute_dtype) == jnp.float32:
            level = gpu_common.dot_precision(options.precision, compute_dtype, False)
            if level != gpu_common.dot_precision("default", compute_dtype, False):
                raise NotImplementedError(
                    f"{what} computes float32 dots as TF32 wgmma (JAX's default precision), "
                    f"the call asks for {level}"
                )
        # The plan __call__ runs, with the live-row scratch wherever a row may be dead.
        plan = self._make(query, key, value, biases, mask, scale, compute_dtype, options)
        need = shared_memory_bytes(plan)
        if need > SHARED_MEMORY_LIMIT:
            raise NotImplementedError(
                f"{what} needs {need:,} bytes of shared memory at head dims "
                f"{query.shape[-1]}/{value.shape[-1]} ({jnp.dtype(compute_dtype)}), over the "
                f"{SHARED_MEMORY_LIMIT:,} an H100 block has"
            )
        return plan

    def _make(self, query, key, value, biases, mask, scale, compute_dtype, options) -> Plan:
        live_q, _ = base.live_shapes(options.structure, mask, query.shape[1], key.shape[1])
        live = live_q is not None
        return Plan.make(self, query, key, value, biases, mask, scale, compute_dtype, options, live)

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
        structure = options.structure
        first = options.positions_first
        shapes = base.unpacked_shapes(query, key, value, options)
        (batch, q_len), k_len = shapes[0].shape[:2], shapes[1].shape[1]
        live_q, live_k = structure.live(mask, q_len, k_len)
        if plan is None:
            plan = self._make(*shapes, biases, mask, scale, compute_dtype, options)
        zero = live_q is not None and not plan.live  # float32: in the transposed copies' pass
        if plan.packed and not _in_place(plan, query, q_len, k_len, zero):
            # Inputs the kernels cannot read as they lie are prepared (cast, padded) per slot.
            query, key, value = base.unpacked(query)
            plan = dataclasses.replace(plan, packed=False)
        if plan.packed:
            out, lse = _attention(plan, query, query, query, *_pair_and_extras(
                plan, biases, mask, live_q, live_k, structure, batch, q_len, k_len
            ))  # fmt: skip
            values = base.values_of(value, options, live_q)
            return self._finish(out, lse, plan, query, values, live_q, q_len, options)
        group = query.shape[2] // key.shape[2]
        if zero and group > 1 and live_k.shape[1] > 1:
            # Keys are zeroed where no query of a head sees them: each query head gets its own
            # copy of its key/value head (XLA sums the copies' gradients).
            key, value = (jnp.repeat(x, group, axis=2) for x in (key, value))
            plan = dataclasses.replace(plan, kv_heads=plan.heads)
        rows = functools.partial(_rows, dtype=compute_dtype, positions_first=first)
        q = rows(query, live_q if zero else None, plan.q_pad, plan.head_dim)
        k = rows(key, live_k if zero else None, plan.k_pad, plan.head_dim)
        v = rows(value, live_k if zero else None, plan.k_pad, plan.value_dim)
        out, lse = _attention(plan, q, k, v, *_pair_and_extras(
            plan, biases, mask, live_q, live_k, structure, batch, q_len, k_len
        ))  # fmt: skip
        return self._finish(out, lse, plan, query, value, live_q, q_len, options)

    @staticmethod
    def _finish(out, lse, plan, query, value, live_q, q_len, options):
        """The kernels' padded output as the op returns it."""
        first = options.positions_first
        out = out[:q_len] if first else out[:, :q_len]
        out = out[..., : value.shape[-1]].astype(query.dtype)
        return numerics.finish_rows_without_key(
            out, lse[:, :, :q_len], value, live_q, options.return_residual, positions_first=first
        )


def _fits(
    dtype, head_dim: int, block_k: int, rows: int, bias: str, mask: str, consumers: int = 1
) -> bool:
    """Whether the kernels' shared memory at those tiles, rows a program and consumer
    warpgroups fits an H100 block,
    planned at AF2's MSA row form (a [1, 1, T, S] bias; 'both' a [B, 1, T, S] one too; a [B, 1,
    1, S] key mask or a [B, 1, T, S] full one)."""
    sd = jax.ShapeDtypeStruct
    q = sd((rows, 384, 1, head_dim), dtype)
    biases = [sd((1, 1, 384, 384), dtype)] + [sd((rows, 1, 384, 384), dtype)] * (bias == "both")
    mask = None if mask == "none" else sd((rows, 1, 384 if mask == "full" else 1, 384), jnp.bool_)
    impl = MosaicAttention(
        block_k=block_k, rows_per_program=rows, consumer_warpgroups=consumers, interpret=True
    )
    plan = impl._make(q, q, q, biases, mask, 1.0, dtype, base.PLAIN)
    return shared_memory_bytes(plan) <= SHARED_MEMORY_LIMIT


def _in_place(plan: Plan, qkv, q_len: int, k_len: int, zero: bool) -> bool:
    """Whether the kernels read a packed array as it lies: in the compute dtype, in whole tiles
    and head dims wgmma takes, with no rows to zero beforehand (float32's TF32 reads transposed
    copies, so half precision only)."""
    whole = plan.q_pad == q_len and plan.k_pad == k_len and plan.head_dim == qkv.shape[-1]
    return whole and qkv.dtype == jnp.dtype(plan.compute_dtype) and not plan.tf32 and not zero


def _pair_and_extras(plan: Plan, biases, mask, live_q, live_k, structure, batch, q_len, k_len):
    """(biases, extras) as the kernels take them: padded to the plan's tiles, the mask in its
    dtype, the live vectors (Plan.live) and the structure's meta."""
    pair = tuple(_pair(x, shape) for x, shape in zip(biases, plan.bias_shapes, strict=True))
    extras = []
    if mask is not None:
        extras.append(_pair(mask, plan.mask_shape).astype(plan.mask_dtype))
    if plan.live:  # int32 [B|1, N|1, L] padded: dead rows zeroed inside the kernels
        for x, real, length in ((live_q, q_len, plan.q_pad), (live_k, k_len, plan.k_pad)):
            x = jnp.broadcast_to(x, (*x.shape[:2], real))  # [.., 1] from a key mask
            pad = ((0, 0), (0, 0), (0, length - real))
            extras.append(jnp.pad(x.astype(jnp.int32), pad))
    if not structure.trivial:
        extras.append(structure.meta(batch))
    return pair, tuple(extras)


def _rows(x, live, length: int, width: int, dtype, positions_first: bool = False):
    """[B, L, H, D] ([L, B, H, D] positions first) in `dtype` with the rows `live` ([B|1, H|1, L]
    or None) lacks zeroed, padded to `length` rows and `width` features."""
    x = x.astype(dtype)
    if live is not None:
        keep = jnp.transpose(live, (2, 0, 1) if positions_first else (0, 2, 1))[..., None]
        x = jnp.where(keep, x, jnp.zeros((), dtype))
    rows = (0, length - x.shape[0 if positions_first else 1])
    pad = (rows, (0, 0)) if positions_first else ((0, 0), rows)
    pad = (*pad, (0, 0), (0, width - x.shape[3]))
    return jnp.pad(x, pad) if any(p[1] for p in pad) else x


def _pair(x, shape):
    """A [B|1, N|1, T|1, S|1] bias or mask padded to the plan's `shape` (zeros: no bias; for a
    mask, masked), a [.., 1, 1] one broadcast over the keys."""
    if x.shape[2] == 1 and x.shape[3] == 1:
        x = jnp.broadcast_to(x, (*x.shape[:3], shape[3]))
        return x
    pad = [(0, 0), (0, 0), (0, shape[2] - x.shape[2]), (0, shape[3] - x.shape[3])]
    return jnp.pad(x, pad) if any(p[1] for p in pad) else x


_attention = base.kernel_attention(forward, backward)
