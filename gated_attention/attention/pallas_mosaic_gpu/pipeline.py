"""What the Mosaic GPU kernels (attention/pallas_mosaic_gpu/kernels_sm90.py) share: the pipeline (`pipeline`: a producer
warpgroup streams tiles by TMA into DEPTH shared-memory slots, each consumer warpgroup waits for
each slot, computes with wgmma and releases it; Schedule, two consumers' ping-pong), the streams of bias, mask and live-row tiles, the
zeroing of dead rows in shared memory, the logits of a tile and the key and query block ranges
(masking's one rule).

Every kernel's inputs are padded (attention/pallas_mosaic_gpu/implementation.py): sequence lengths to whole tiles, head dims for
wgmma; keys past the real length are -inf in every tile, rows past it are sliced off.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax

from gated_attention.attention.gpu_common import MASKED
from gated_attention.attention.pallas_mosaic_gpu.plan import (
    DEPTH,
    K,
    Plan,
    V,
    broadcast_form,
    modules,
)
from gated_attention.core import compat, masking


class Stream(NamedTuple):
    """One input streamed through the pipeline: source(r, j) is the global-memory slice of step
    (r, j), copied into buffers.at[slot]; barriers.at[slot] says it arrived."""

    source: Callable
    buffers: Any
    barriers: Any


# Registers a thread of a 3-warpgroup program (65536 / 384 = 170 each at launch): the
# producer gives back to the two consumers (setmaxnreg; 2 x 232 + 40 <= 512, multiples of 8).
PRODUCER_REGISTERS, CONSUMER_REGISTERS = 40, 232
SCHEDULE = 4  # named barriers 4 and 5: Mosaic GPU keeps 0 and 1 .. warpgroups for its own


def pipeline(plan, rows: int, span, streams, consumed, begin, step, end, carry_rows=False):
    """For r < rows and j in span(r) = [lo, hi): the producer (the last warpgroup) copies every
    stream's slice of (r, j) into slot count % DEPTH, first waiting until every consumer released
    the slot's previous use; each consumer c < Plan.consumer_warpgroups (warpgroup c) runs carry
    = begin(c, r), carry = step(c, r, j, slot, carry) once the slot's copies arrived, then
    end(c, r, carry), all consumers over the same slots. carry_rows: one carry over all rows,
    begin(c, None) before the first and end(c, None, carry) after the last. Alone (the
    interpreter's one warpgroup) the consumers run one after the other, issuing their copies."""
    pl, plgpu = modules()
    wg = lax.axis_index("wg")
    consumers = plan.consumer_warpgroups
    alone = plan.warpgroups == 1  # the consumer issues its own copies (INTERPRET_WARPGROUPS)
    rebalance = consumers > 1 and not plan.interpret  # the interpreter has no registers

    def issue(r, j, slot):
        for s in streams:
            plgpu.copy_gmem_to_smem(s.source(r, j), s.buffers.at[slot], s.barriers.at[slot])

    def produce():
        if rebalance:
            plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

        def row(r, count):
            def load(j, count):
                slot = lax.rem(count, jnp.int32(DEPTH))

                @pl.when(count >= DEPTH)
                def _():
                    plgpu.barrier_wait(consumed.at[slot])

                issue(r, j, slot)
                return count + 1

            return lax.fori_loop(*span(r), load, count)

        count = lax.fori_loop(0, rows, row, jnp.int32(0))

        # Wait for the last uses too: every phase of a barrier is observed by its waiter.
        @functools.partial(lax.fori_loop, jnp.maximum(count - DEPTH, 0), count, init_val=None)
        def _(c, _):
            plgpu.barrier_wait(consumed.at[lax.rem(c, jnp.int32(DEPTH))])

    if not alone:
        pl.when(wg == consumers)(produce)

    def consume(c):
        if rebalance:
            plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")

        def steps(r, count, carry):
            def compute(j, state):
                count, carry = state
                slot = lax.rem(count, jnp.int32(DEPTH))
                if alone:
                    issue(r, j, slot)
                for s in streams:
                    plgpu.barrier_wait(s.barriers.at[slot])
                carry = step(c, r, j, slot, carry)
                if not alone:
                    plgpu.barrier_arrive(consumed.at[slot])
                return count + 1, carry

            return lax.fori_loop(*span(r), compute, (count, carry))

        if carry_rows:
            _, carry = lax.fori_loop(
                0, rows, lambda r, state: steps(r, *state), (jnp.int32(0), begin(c, None))
            )
            end(c, None, carry)
            return

        def row(r, count):
            count, carry = steps(r, count, begin(c, r))
            end(c, r, carry)
            return count

        lax.fori_loop(0, rows, row, jnp.int32(0))

    for c in range(consumers):
        if alone:
            consume(c)
        else:
            pl.when(wg == c)(functools.partial(consume, c))


class Schedule(NamedTuple):
    """Ping-pong of two consumer warpgroups over hardware named barriers (compiled only): a
    consumer hands the tensor cores over once its s = q @ k.T is issued and waits for its turn
    before p @ v, so one's wgmma runs under the other's softmax. Consumer 1 starts by waiting
    (first), consumer 0 ends by handing over (last), so both barriers balance."""

    on: bool

    def _bar(self, action: str, barrier: int):
        if self.on:
            _, plgpu = modules()
            compat.named_barrier(plgpu, action, SCHEDULE + barrier, 2 * 128)

    def hand_over(self, c: int):
        self._bar("arrive", 1 - c)

    def wait_turn(self, c: int):
        self._bar("sync", c)

    def first(self, c: int):
        if c == 1:
            self.wait_turn(c)

    def last(self, c: int):
        if c == 0:
            self.hand_over(c)


def zero_dead_rows(plan: Plan, ref, live_ref):
    """Zeroes the rows of a shared-memory tile [rows, width] whose entry of the int32 vector
    live_ref [rows] is 0: queries with no key, keys no query sees, so that garbage there (NaN,
    inf) never meets a zero weight in a dot (0 x NaN is NaN)."""
    pl, plgpu = modules()
    ops = plan.ops
    live = ops.load(live_ref, axis=1) != 0
    width = 128 // jnp.dtype(ref.dtype).itemsize  # one swizzle row's columns at a time
    for start in range(0, ref.shape[1], width):
        part = ref.at[:, pl.ds(start, min(width, ref.shape[1] - start))]
        x = ops.load(part)
        part[...] = jnp.where(lax.broadcast_in_dim(live, x.shape, (0,)), x, jnp.zeros((), x.dtype))
    plgpu.commit_smem()  # before the tensor cores read the tile


def vector_source(plan: Plan, ref, b_of, head_of, block_of, size: int):
    """source(r, j) of an int32 live vector [B|1, N|1, L] in blocks of `size`."""
    pl, _ = modules()

    def source(r, j):
        bb = b_of(r) if ref.shape[0] > 1 else 0
        nn = head_of(r) if ref.shape[1] > 1 else 0
        return ref.at[bb, nn, pl.ds(block_of(r, j) * size, size)]

    return source


def live_scratch(plan: Plan, size: int) -> list:
    """DEPTH slots of a live vector and their barriers (when the plan has them)."""
    if not plan.live:
        return []
    _, plgpu = modules()
    return [plan.smem((DEPTH, size), jnp.int32), plgpu.Barrier(num_barriers=DEPTH)]


def lhs_operand(plan: Plan, x, staging):
    """Registers x as a wgmma left operand: as they are in 16-bit types; through the shared-memory
    `staging` tile for float32 (TF32 wgmma reads A from shared memory only)."""
    x = x.astype(plan.compute_dtype)
    if staging is None:
        return x
    _, plgpu = modules()
    staging[...] = x
    plgpu.commit_smem()  # order the stores before the tensor cores' reads
    return staging


def staging_scratch(plan: Plan, rows: int, cols: int):
    """The scratch operand needs: a float32 tile, or none."""
    if jnp.dtype(plan.compute_dtype) != jnp.float32:
        return []
    return [plan.smem((rows, cols), jnp.float32, operand=True)]


def gather(ref, form: str, b, n, i, j, plan: Plan, transposed: bool = False):
    """The global slice of a [B|1, N|1, T|1, S|1] array (transposed: [B|1, N|1, S, T], tiles
    only) for query block i, key block j."""
    pl, _ = modules()
    bb = b if ref.shape[0] > 1 else 0
    nn = n if ref.shape[1] > 1 else 0
    qs, ks = pl.ds(i * plan.block_q, plan.block_q), pl.ds(j * plan.block_k, plan.block_k)
    if form == "tile":
        return ref.at[bb, nn, ks, qs] if transposed else ref.at[bb, nn, qs, ks]
    return ref.at[bb, nn, 0, ks] if form == "keys" else ref.at[bb, nn, qs, 0]


def tile_buffer(plan: Plan, shape, dtype, transposed: bool = False):
    """DEPTH slots for one bias or mask's tiles."""
    tile = {
        "tile": (plan.block_k, plan.block_q) if transposed else (plan.block_q, plan.block_k),
        "keys": (plan.block_k,),
        "queries": (plan.block_q,),
    }[broadcast_form(shape)]
    return plan.smem((DEPTH, *tile), dtype)


def widen(plan: Plan, ref, shape, transposed: bool = False):
    """A bias or mask slot to registers: [bq, bk] ([bk, bq] transposed, from a transposed tile)."""
    ops = plan.ops
    form = broadcast_form(shape)
    if form == "tile":
        return ops.load(ref)
    tile = (plan.block_k, plan.block_q) if transposed else (plan.block_q, plan.block_k)
    q_axis = 1 if transposed else 0
    along = 1 - q_axis if form == "keys" else q_axis
    return lax.broadcast_in_dim(ops.load(ref, axis=1 - along), tile, (along,))


class Meta(NamedTuple):
    offset: Any
    q_length: Any
    kv_length: Any


def row_structure(meta_ref, b):
    """Batch row b's structure scalars (masking.StructuredMask.meta), or None."""
    if meta_ref is None:
        return None
    return Meta(meta_ref[b, 0], meta_ref[b, 1], meta_ref[b, 2])


def key_blocks(plan: Plan, st, i):
    """[lo, hi): the key blocks some query of query block i may attend."""
    if st is None:
        return jnp.int32(0), jnp.int32(plan.k_blocks)
    return masking.key_tiles(
        st.offset + i * plan.block_q, plan.block_q, plan.block_k, plan.causal, plan.window,
        plan.k_len, st.q_length, st.kv_length,
    )  # fmt: skip


def query_blocks(plan: Plan, st, j):
    """[lo, hi): the query blocks with a query that may attend some key of key block j."""
    if st is None:
        return jnp.int32(0), jnp.int32(plan.q_blocks)
    return masking.query_tiles(
        j * plan.block_k, plan.block_k, plan.block_q, plan.causal, plan.window, st.offset,
        plan.q_len, st.q_length, st.kv_length,
    )  # fmt: skip


def logits(plan: Plan, s, bias_tiles, mask_tile, st, i, j, transposed: bool = False):
    """Scaled, biased, soft-capped, masked float32 logits of tile (i, j) from the product `s`
    ([bq, bk], or [bk, bq] transposed), and the soft cap's derivative (None: no cap). Keys
    past the real length are -inf."""
    ops = plan.ops
    s = s * plan.scale
    for bias in bias_tiles:
        s = s + bias.astype(jnp.float32)
    cap_grad = None
    if plan.soft_cap is not None:
        t = jnp.tanh(s * (1.0 / plan.soft_cap))
        s, cap_grad = plan.soft_cap * t, 1.0 - t * t
    if mask_tile is not None:
        s = jnp.where(mask_tile != 0, s, MASKED)
    tile = s.shape
    q_axis, k_axis = (1, 0) if transposed else (0, 1)
    kj = None
    if st is not None or plan.k_pad != plan.k_len:
        kj = j * plan.block_k + ops.iota(tile, k_axis)
    if st is not None:
        qi = st.offset + i * plan.block_q + ops.iota(tile, q_axis)
        ok = masking.allowed(qi, kj, plan.causal, plan.window, st.q_length, st.kv_length)
        s = jnp.where(ok, s, MASKED)
    if plan.k_pad != plan.k_len:
        s = jnp.where(kj < plan.k_len, s, -jnp.inf)
    return s, cap_grad


def pair_streams(
    plan: Plan, bias_refs, mask_ref, scratch, b_of, n_of, i_of, j_of, transposed=False
):
    """Streams and slot buffers of the biases and the mask: (streams, bias slot refs, mask slot
    ref or None), popping their buffers and barriers from `scratch`."""
    streams, bias_slots = [], []
    shapes = list(plan.bias_shapes) + ([plan.mask_shape] if mask_ref is not None else [])
    refs = list(bias_refs) + ([mask_ref] if mask_ref is not None else [])
    for ref, shape in zip(refs, shapes, strict=True):
        buf, bar = scratch.pop(0), scratch.pop(0)
        form = broadcast_form(shape)

        def source(r, j, ref=ref, form=form):
            return gather(ref, form, b_of(r), n_of(r), i_of(r, j), j_of(r, j), plan, transposed)

        streams.append(Stream(source, buf, bar))
        bias_slots.append(buf)
    mask_slots = bias_slots.pop() if mask_ref is not None else None
    return streams, bias_slots, mask_slots


def row_pair_streams(plan: Plan, bias_refs, mask_ref, scratch, at):
    """pair_streams for a forward step over several parts (Plan.parts: batch row b, query block
    i for each; at(r) -> (parts, head n) of work item r): an array each part needs its own tiles
    of (Plan.own_tiles) gets a stream per part, any other one stream whose slot every part reads
    (a bias shared over the batch loaded once a key block for all rows; a key-only one for both
    consumers). (streams, bias slot refs per part [part][t], mask slot ref per part or None),
    popping buffers and barriers from `scratch` in pair_scratch(plan, parts=Plan.parts)'s order."""
    streams = []
    per_part = [[] for _ in range(plan.parts)]
    shapes = list(plan.bias_shapes) + ([plan.mask_shape] if mask_ref is not None else [])
    refs = list(bias_refs) + ([mask_ref] if mask_ref is not None else [])
    for ref, shape in zip(refs, shapes, strict=True):
        form = broadcast_form(shape)
        own = plan.own_tiles(shape)
        bufs = []
        for a in range(plan.parts if own else 1):
            buf, bar = scratch.pop(0), scratch.pop(0)

            def source(r, j, ref=ref, form=form, a=a):
                parts, n = at(r)
                b, i = parts[a]
                return gather(ref, form, b, n, i, j, plan)

            streams.append(Stream(source, buf, bar))
            bufs.append(buf)
        for c, slots in enumerate(per_part):
            slots.append(bufs[c] if own else bufs[0])
    masks = [slots.pop() for slots in per_part] if mask_ref is not None else [None] * plan.parts
    return streams, per_part, masks


def pair_scratch(plan: Plan, transposed: bool = False, parts: int = 1):
    """Scratch for pair_streams: (buffer, barriers) per bias, then the mask's; `parts` of them
    for an array each part of a forward program needs its own tiles of (row_pair_streams), one
    for the others."""
    _, plgpu = modules()
    out = []
    pairs = list(zip(plan.bias_shapes, plan.bias_dtypes, strict=True))
    if plan.mask_shape is not None:
        pairs.append((plan.mask_shape, plan.mask_dtype))
    for shape, dtype in pairs:
        for _ in range(parts if plan.own_tiles(shape) else 1):
            buffer = tile_buffer(plan, shape, dtype, transposed)
            out += [buffer, plgpu.Barrier(num_barriers=DEPTH)]
    return out


def kv_tile(plan: Plan, width: int):
    """DEPTH slots of a key-side operand read as a wgmma right operand [bk, width] (TF32: its
    transpose [width, bk])."""
    return (DEPTH, width, plan.block_k) if plan.tf32 else (DEPTH, plan.block_k, width)


def split_refs(plan: Plan, refs, n_front: int):
    """refs -> (front refs, bias refs, mask ref, (live_q, live_k) refs, meta ref, rest)."""
    refs = list(refs)
    front = [refs.pop(0) for _ in range(n_front)]
    biases = [refs.pop(0) for _ in range(len(plan.bias_shapes))]
    mask = refs.pop(0) if plan.mask_shape is not None else None
    live = (refs.pop(0), refs.pop(0)) if plan.live else (None, None)
    meta = refs.pop(0) if plan.structured else None
    return front, biases, mask, live, meta, refs


def row_streams(plan: Plan, at, k_ref, v_ref, scratch):
    """(streams, k buffers, v buffers) of the forward's rows (at(r) -> (batch rows, key/value
    head kv) of work item r): each row's k and v tiles of head kv, in the slots it takes from
    the front of `scratch` (forward_scratch's order)."""
    pl, _ = modules()

    def k_source(a):
        def source(r, j):
            rows, kv = at(r)
            return plan.rows(k_ref, rows[a], pl.ds(j * plan.block_k, plan.block_k), kv, K)

        return source

    def v_source(a):
        def source(r, j):
            rows, kv = at(r)
            if plan.tf32:  # v transposed: [B, K, Dv, S]
                return v_ref.at[rows[a], kv, :, pl.ds(j * plan.block_k, plan.block_k)]
            return plan.rows(v_ref, rows[a], pl.ds(j * plan.block_k, plan.block_k), kv, V)

        return source

    streams, k_bufs, v_bufs = [], [], []
    for a in range(plan.rows_per_program):
        k_buf, k_bar, v_buf, v_bar = (scratch.pop(0) for _ in range(4))
        streams += [Stream(k_source(a), k_buf, k_bar), Stream(v_source(a), v_buf, v_bar)]
        k_bufs.append(k_buf)
        v_bufs.append(v_buf)
    return streams, k_bufs, v_bufs
