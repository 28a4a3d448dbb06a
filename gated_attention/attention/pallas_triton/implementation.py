"""A fused attention kernel for GPUs in Pallas (Triton lowering), biases shared over the batch included.

Forward: one program per (batch row, head, block of queries) streams the keys in blocks with an
online softmax (FlashAttention-2) and saves the log-sum-exp of each query. Every bias and the mask
are read tile by tile through their own broadcast dimensions, so a [1, N, T, S] bias is read by
every batch row and never copied per row, and a key mask is never expanded to [B, N, T, S].

Backward, two kernels, no atomics, so the gradients are deterministic:
  * dk, dv: one program per (batch row, head, block of keys), looping over the query blocks;
  * dq and the bias gradients: one program per (group of batch rows, head, block of queries),
    looping over its rows and the key blocks. The program owns the bias-gradient tiles of its
    group, head and queries in a float32 buffer: per batch row for a per-row bias, per group for a
    bias shared over the batch (summed over a size-1 T or S dimension inside the tile). So no
    [B, N, T, S] array is written for a shared bias; XLA sums the few group partials afterwards.
    Groups exist only to give the GPU enough programs: about `bias_grad_programs` of them, so
    the partials take about bias_grad_programs x block_q x S x 4 bytes (128 MiB at S = 1,024).
Or, with `fused_backward`, one kernel, still without atomics: per (group of batch rows, head,
block of keys), each tile's weights and their gradient computed once, dq summed by XLA from
per-key-block float32 partials (attention/pallas_triton/kernels_fused.py).

Numerics follow numerics.py: logits, softmax and accumulation in float32; masked logits are
selected to MASK_VALUE (a fully masked row is then uniform); queries with no key and keys no query
sees are zeroed as they are loaded (so masked garbage never leaks), and fully masked rows get the
uniform average of the values as given. float32 dots follow JAX's matmul precision as XLA's do on
a GPU (dot_precision): TF32 tensor-core MMAs by default, three TF32 passes at 'high', IEEE at
'highest'. Head dims up to 128 are padded inside the tiles to a power of two of at least 16
(Triton's smallest dot); sequence lengths need not be multiples of the blocks (masked loads).

Files: this one, the implementation (check, tiles, __call__) and the kernels' custom VJP;
attention/pallas_triton/plan.py, the static facts of a call (Plan: tiles, batch-row groups, the launch);
attention/pallas_triton/kernels.py, the kernel bodies and their launches; attention/pallas_triton/tile_table.py, the tile table.

`interpret=True` runs the same kernels in Pallas's interpreter on any backend: how they are tested
on machines without a GPU. Without it the kernels run on GPU only (check() says so elsewhere).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from gated_attention.attention import base
from gated_attention.attention.gpu_common import dot_precision
from gated_attention.attention.pallas_triton import kernels as pallas_kernels
from gated_attention.attention.pallas_triton import kernels_fused as fused_kernels
from gated_attention.attention.pallas_triton import tile_table as pallas_tiles
from gated_attention.attention.pallas_triton.plan import (
    ROWS_HEAD_DIM,
    Plan,
    triton_backend_missing,
)
from gated_attention.attention.pallas_triton.tile_table import MIN_TILE, _pow2_tile
from gated_attention.core import checks, memory, numerics, platforms

DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_HEAD_DIM = 128
MAX_ROWS_PER_PROGRAM = 4  # each row holds its own accumulator and queries in registers
# The candidates' bounds (candidates()): the kernel matrices compiled tiles up to 64 and up to 4
# stages (benchmark_results/gpu_kernels/); one doubling past them is tried, no further.
MAX_CANDIDATE_TILE = 128
MAX_CANDIDATE_STAGES = 4
# The fused backward's float32 dq partials are one copy of q per key block: at most this many
# (8 x q's float32 size; AF2's MSA row at 384 keys takes 6 blocks of 64, a triangle at 1,024
# refused at 64 keys a tile, taken at 128).
MAX_FUSED_KEY_BLOCKS = 8


@dataclasses.dataclass(frozen=True)
class PallasAttention(base.Implementation):
    """Fused attention in Pallas/Triton with per-bias broadcast and a deterministic bias gradient.

    Attributes:
      block_q: queries per tile (a power of two >= 16; shorter sequences take a smaller tile;
        None: from pallas_tiles' table).
      block_k: keys per tile (likewise).
      num_warps: Triton warps per program (None: from pallas_tiles' table).
      num_stages: Triton software-pipelining stages (None: from pallas_tiles' table).
      bias_grad_programs: about how many programs the dq/bias-gradient kernel should have when a
        bias is shared over the batch; batch rows are grouped so that it does.
      rows_per_program: batch rows one forward program computes when a bias is shared over the
        batch: the program reads each tile of that bias once for them all (AF2's pair bias is
        the same for every MSA row). None: 2 in half precision at head dims up to 32 (AF2's)
        on Hopper, else 1. Always 1 without such a bias or with the op's further arguments (a causal,
        window or length mask, whose key blocks differ from row to row; grouped heads; a soft
        cap).
      fused_backward: run the backward as one kernel (attention/pallas_triton/kernels_fused.py)
        that computes each tile's softmax weights and their gradient once, where the two
        kernels compute them twice: one program per key block writes its float32 share of dq
        into a buffer of (key blocks) x q's size, which XLA sums (no atomics); refused past
        MAX_FUSED_KEY_BLOCKS key blocks. False: the dk/dv and dq/bias-gradient kernels, which
        need no such buffer.
      interpret: run the kernels in Pallas's interpreter (any backend; slow, for tests).
    """

    name = "pallas"
    block_q: int | None = None
    block_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    bias_grad_programs: int = 512
    rows_per_program: int | None = None
    fused_backward: bool = False
    interpret: bool = False

    # Reads [T, B, N, H] (Plan.columns) and packed q/k/v (Plan.packed) in place.
    TAKES = base.ALL_OPTIONS | {"positions_first", "packed"}
    CANDIDATE_FIELDS = dict(
        block_q="bq",
        block_k="bk",
        num_warps="w",
        num_stages="s",
        rows_per_program="r",
        fused_backward="f",
    )
    BACKWARD_FIELDS = frozenset({"fused_backward"})

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            value = checks.check_int(name, getattr(self, name), minimum=MIN_TILE, optional=True)
            if value is not None and value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= {MIN_TILE}, got {value}")
        checks.check_int("num_warps", self.num_warps, optional=True)
        checks.check_int("num_stages", self.num_stages, optional=True)
        checks.check_int("bias_grad_programs", self.bias_grad_programs)
        rows = checks.check_int("rows_per_program", self.rows_per_program, optional=True)
        if rows is not None and rows > MAX_ROWS_PER_PROGRAM:
            raise ValueError(
                f"rows_per_program must be None or an int in [1, {MAX_ROWS_PER_PROGRAM}], got {rows}"
            )
        checks.check_bool("fused_backward", self.fused_backward)
        checks.check_bool("interpret", self.interpret)

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
        missing = triton_backend_missing()
        if missing is not None:
            raise NotImplementedError(missing)
        base.check_kernel(
            "the Pallas kernel",
            "gpu",
            impl=self,
            platform=platform,
            compute_dtype=compute_dtype,
            dtypes=DTYPES,
            query=query,
            value=value,
            max_head_dim=MAX_HEAD_DIM,
        )
        dims = (query.shape[-1], value.shape[-1])
        plan = self._make(query, key, value, biases, mask, scale, compute_dtype, options)
        block_q, block_k, stages = plan.block_q, plan.block_k, plan.num_stages
        need = memory.gpu_shared_memory_bytes(
            block_q=block_q,
            block_k=block_k,
            stages=stages,
            padded_head_dim=_pow2_tile(max(dims)),
            itemsize=jnp.dtype(compute_dtype).itemsize,
            pair_itemsize=sum(jnp.dtype(b.dtype).itemsize for b in biases) + (mask is not None),
        )
        group = pallas_tiles.shared_memory_class()
        limit = pallas_tiles.SHARED_MEMORY_CLASSES[group]
        if need > limit:
            raise NotImplementedError(
                f"tiles {block_q} x {block_k} with {stages} stages need about {need:,} bytes of "
                f"shared memory at head dim {max(dims)} ({jnp.dtype(compute_dtype)}), over the "
                f"{limit:,} a block has on this GPU ({group} shared memory): take smaller tiles"
            )
        blocks = -(-key.shape[1] // block_k)
        if plan.fused_backward and blocks > MAX_FUSED_KEY_BLOCKS:
            raise NotImplementedError(
                f"the fused backward keeps a float32 copy of dq per key block: {blocks} blocks "
                f"of {block_k} at {key.shape[1]} keys, over its {MAX_FUSED_KEY_BLOCKS} (take "
                f"fused_backward=False, or block_k >= {-(-key.shape[1] // MAX_FUSED_KEY_BLOCKS)})"
            )
        return plan

    @classmethod
    def candidates(
        cls, capability, dtype, head_dim: int, *, bias: str = "shared", mask: str = "key"
    ) -> list[dict]:
        """What the instance takes by default on that GPU (pallas_tiles' tiles for the dtype at
        JAX's default precision, the head dim and the form; the rows a program Plan.make takes)
        first, then each one-field neighbour of it: block_q or block_k halved or doubled (16 to
        128), the other of 4 and 8 warps, one pipeline stage fewer or more (1 to 4), and with a
        bias shared over the batch the other of 1 and 2 rows a program; last, in half
        precision, the first with the fused backward (f1). Those whose shared memory
        (memory.gpu_shared_memory_bytes) is over the GPU's shared-memory class's limit, which
        plan() refuses there, are left out. Head dims over MAX_HEAD_DIM: none."""
        if head_dim > MAX_HEAD_DIM:
            return []
        dtype = jnp.dtype(dtype)
        padded = _pow2_tile(head_dim)
        group = pallas_tiles.shared_memory_class(platforms.shared_memory_per_block(capability))
        block_q, block_k, warps, stages = pallas_tiles.lookup(
            dtype, None, padded, False, (bias, mask), shared_memory=group
        )
        shared = bias in ("shared", "both")
        hopper = capability is not None and capability[0] == platforms.HOPPER
        half = dtype.itemsize == 2
        rows = 2 if shared and half and hopper and padded <= ROWS_HEAD_DIM else 1
        first = dict(
            block_q=block_q, block_k=block_k, num_warps=warps, num_stages=stages,
            rows_per_program=rows,
        )  # fmt: skip
        moves = [("block_q", block_q // 2), ("block_q", block_q * 2)]
        moves += [("block_k", block_k // 2), ("block_k", block_k * 2)]
        moves += [("num_warps", 4 if warps == 8 else 8)]
        moves += [("num_stages", stages - 1), ("num_stages", stages + 1)]
        moves += [("rows_per_program", 3 - rows)] if shared else []
        pair = dtype.itemsize * (2 if bias == "both" else bias != "none") + (mask != "none")
        out = []
        for field, value in [(None, None), *moves]:
            option = first if field is None else first | {field: value}
            tiles_ok = all(
                MIN_TILE <= option[f] <= MAX_CANDIDATE_TILE for f in ("block_q", "block_k")
            )
            if not tiles_ok or not 1 <= option["num_stages"] <= MAX_CANDIDATE_STAGES:
                continue
            need = memory.gpu_shared_memory_bytes(
                block_q=option["block_q"], block_k=option["block_k"],
                stages=option["num_stages"], padded_head_dim=padded, itemsize=dtype.itemsize,
                pair_itemsize=pair,
            )  # fmt: skip
            if need <= pallas_tiles.SHARED_MEMORY_CLASSES[group] and option not in out:
                out.append(option)
        if out and half:  # float32's fused kernel spills on the A100, Ada and sm_120
            out.append(out[0] | dict(fused_backward=True))
        return out

    def _make(self, query, key, value, biases, mask, scale, compute_dtype, options) -> Plan:
        live_q, _ = base.live_shapes(options.structure, mask, query.shape[1], key.shape[1])
        precision = dot_precision(options.precision, compute_dtype, self.interpret)
        return Plan.make(
            self, query, key, value, biases, scale, compute_dtype, precision, mask, live_q, options
        )

    def tiles(
        self,
        compute_dtype,
        precision,
        head_dim: int,
        options: bool = False,
        form: tuple[str, str] | None = None,
    ) -> tuple[int, int, int, int]:
        """(block_q, block_k, num_warps, num_stages): the fields where given, else pallas_tiles'
        table's for the dtype, the dots' precision, the head dim, whether `options` (the op's
        further arguments) are asked and the call's kernel_form (None: the heaviest form)."""
        table = pallas_tiles.lookup(compute_dtype, precision, head_dim, options, form)
        given = (self.block_q, self.block_k, self.num_warps, self.num_stages)
        return tuple(g if g is not None else t for g, t in zip(given, table, strict=True))

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
        # Live queries [B|1, N|1, T|1] and keys [B|1, N|1, S|1] under the mask and the structure.
        live_q, live_k = structure.live(mask, q_len, k_len)
        extras = []
        if mask is not None:
            extras.append(mask.astype(jnp.int8))  # int8 for Triton
        if live_q is not None:
            extras += [live_q.astype(jnp.int8), live_k.astype(jnp.int8)]
        if not structure.trivial:
            extras.append(structure.meta(batch))
        if plan is None:
            plan = self._make(*shapes, biases, mask, scale, compute_dtype, options)
        out, lse = _attention(plan, query, key, value, tuple(biases), tuple(extras))
        return numerics.finish_rows_without_key(
            out,
            lse,
            base.values_of(value, options, live_q),
            live_q,
            options.return_residual,
            positions_first=first,
        )


def _backward(plan: Plan, residuals, cotangents):
    """The two-kernel backward, or the one fused kernel (Plan.fused_backward)."""
    run = fused_kernels.backward if plan.fused_backward else pallas_kernels.backward
    return run(plan, residuals, cotangents)


_attention = base.kernel_attention(pallas_kernels.forward, _backward)
