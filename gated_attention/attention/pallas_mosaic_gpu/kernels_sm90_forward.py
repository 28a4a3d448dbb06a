"""The Mosaic GPU forward kernel (attention/pallas_mosaic_gpu/implementation.py's docstring: grid, numerics), its
shared-memory scratch and launch: one program per tile (batch rows, head, query blocks), or
(persistent) one per streaming multiprocessor looping over the tiles; the online softmax over
the key blocks the pipeline (attention/pallas_mosaic_gpu/pipeline.py) streams.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from gated_attention.attention.gpu_common import LOG2E
from gated_attention.attention.pallas_mosaic_gpu.pipeline import (
    Schedule,
    Stream,
    key_blocks,
    kv_tile,
    lhs_operand,
    live_scratch,
    logits,
    pair_scratch,
    pipeline,
    row_pair_streams,
    row_streams,
    row_structure,
    split_refs,
    staging_scratch,
    vector_source,
    widen,
    zero_dead_rows,
)
from gated_attention.attention.pallas_mosaic_gpu.plan import DEPTH, Plan, Q, modules
from gated_attention.core import numerics


def weights(s, shift, q_axis: int):
    """exp(s - shift) of a tile of logits, shift (the row max or the log-sum-exp) along the
    query axis: exp2 of one FFMA and one MUFU.EX2 a score (Mosaic GPU's mul and sub contract)."""
    return jnp.exp2(s * LOG2E - lax.broadcast_in_dim(shift * LOG2E, s.shape, (q_axis,)))


def _parts(plan: Plan, g, p, batch: int):
    """(batch rows, query blocks) of tile (g, p): R = Plan.rows_per_program rows g * R ..
    g * R + R - 1 of block p, or C = Plan.consumer_warpgroups blocks p * C .. p * C + C - 1 of
    row g; past the batch or the last block, the last again (the same values stored twice)."""
    per, cons = plan.rows_per_program, plan.consumer_warpgroups
    rows = [g] if per == 1 else [jnp.minimum(g * per + r, batch - 1) for r in range(per)]
    blocks = (
        [p] if cons == 1 else [jnp.minimum(p * cons + c, plan.q_blocks - 1) for c in range(cons)]
    )
    return rows, blocks


def _tile(plan: Plan, r, batch: int):
    """(g, n, p): the tile of the program's work item r: its grid position, or (persistent,
    Plan.programs) tile t = program + r * programs of Plan.tiles in order, p fastest (the
    programs running at once read the same k and v)."""
    if not plan.programs:
        return lax.axis_index("b"), lax.axis_index("n"), lax.axis_index("i")
    _, heads, spans = plan.tiles(batch)
    last = math.prod(plan.tiles(batch)) - 1
    # Items past the last tile redo it: the same values stored twice, as for clamped rows.
    t = jnp.minimum(lax.axis_index("t") + r * plan.programs, jnp.int32(last))
    per_group = jnp.int32(heads * spans)
    spans = jnp.int32(spans)
    return lax.div(t, per_group), lax.div(lax.rem(t, per_group), spans), lax.rem(t, spans)


class _Item(NamedTuple):
    """A work item: its batch rows, query blocks, head, (row, block) parts and structure."""

    rows: list
    blocks: list
    n: Any
    parts: list
    st: Any


def _items(plan: Plan, batch: int) -> int:
    """Work items a program loops over: 1 (a grid), or the persistent forward's ceil(tiles /
    programs), the last one past the last tile in some programs."""
    return -(-math.prod(plan.tiles(batch)) // plan.programs) if plan.programs else 1


def _key_span(plan: Plan, st, blocks):
    """[lo, hi): the key blocks of the program, the union of its query blocks' (every consumer
    walks the same slots; logits masks each row's own)."""
    spans = [key_blocks(plan, st, i) for i in blocks]
    lo, hi = spans[0]
    for a, b in spans[1:]:
        lo, hi = jnp.minimum(lo, a), jnp.maximum(hi, b)
    return lo, hi


def _live_streams(plan: Plan, live_k_ref, at, scratch):
    """(streams, slot buffers) of each row's live-key vector (Plan.live: keys no query of head n
    sees, zeroed in v before p @ v; at(r) -> (batch rows, n) of work item r), popped from
    `scratch`; none without them."""
    streams, bufs = [], []
    for a in range(plan.rows_per_program) if plan.live else []:
        buf, bar = scratch.pop(0), scratch.pop(0)
        source = vector_source(plan, live_k_ref, lambda r, a=a: at(r)[0][a],
                               lambda r: at(r)[1], lambda r, j: j, plan.block_k)  # fmt: skip
        streams.append(Stream(source, buf, bar))
        bufs.append(buf)
    return streams, bufs


def _item(plan: Plan, meta_ref, batch: int, r) -> _Item:
    """The program's work item r (_tile): its rows, blocks, head, parts and structure."""
    g, n, p = _tile(plan, r, batch)
    rows, blocks = _parts(plan, g, p, batch)
    parts = [(b, i) for b in rows for i in blocks]  # one of the two has one entry
    # Several rows only without a structure (Plan.make): the first row's is every row's.
    return _Item(rows, blocks, n, parts, row_structure(meta_ref, rows[0]))


def _streams(plan: Plan, item, refs, scratch):
    """The forward's streams of work item item(r) (k and v per row, the biases and mask, the
    live keys) and their slot buffers: (streams, k, v, bias slots per part, mask slot per part,
    live-key slots), popped from `scratch` in forward_scratch's order."""
    k_ref, v_ref, bias_refs, mask_ref, live_k_ref = refs
    kv = lambda n: lax.div(n, jnp.int32(plan.q_heads_per_kv_head))  # noqa: E731
    streams, k_bufs, v_bufs = row_streams(
        plan, lambda r: (item(r).rows, kv(item(r).n)), k_ref, v_ref, scratch
    )
    pair, bias_slots, mask_slots = row_pair_streams(
        plan, bias_refs, mask_ref, scratch, lambda r: (item(r).parts, item(r).n)
    )
    live, live_bufs = _live_streams(plan, live_k_ref, lambda r: (item(r).rows, item(r).n), scratch)
    return streams + pair + live, k_bufs, v_bufs, bias_slots, mask_slots, live_bufs


def _forward_kernel(*refs, plan: Plan):
    """The parts (Plan.parts, _parts) of head n in each tile (g, n, p) of the program (_tile): a
    consumer warpgroup each (Plan.consumer_warpgroups), or one for all the rows
    (Plan.rows_per_program). Each key block's step streams every row's k and v tiles, and a bias
    or mask tile once for all the parts that read the same one (row_pair_streams)."""
    pl, plgpu = modules()
    ops, per, cons = plan.ops, plan.rows_per_program, plan.consumer_warpgroups
    front, bias_refs, mask_ref, (_, live_k_ref), meta_ref, refs = split_refs(plan, refs, 3)
    q_ref, k_ref, v_ref = front
    o_ref, lse_ref = refs.pop(0), refs.pop(0)
    q_smem, q_bar, consumed, o_smem, lse_smem, *scratch = refs
    stagings = [scratch.pop(0) if plan.tf32 else None for _ in range(cons)]

    item = functools.partial(_item, plan, meta_ref, lse_ref.shape[0])
    streams, k_bufs, v_bufs, bias_slots, mask_slots, live_bufs = _streams(
        plan, item, (k_ref, v_ref, bias_refs, mask_ref, live_k_ref), scratch
    )
    schedule = Schedule(cons > 1 and not plan.interpret)  # named barriers: compiled only
    mine = lambda c: list(range(per)) if cons == 1 else [c]  # noqa: E731 (consumer c's parts)
    row_of = lambda a: a if per > 1 else 0  # noqa: E731
    q_span = lambda i: pl.ds(i * plan.block_q, plan.block_q)  # noqa: E731

    def begin(c, r):
        _, _, n, parts, _ = item(r)
        for a in mine(c):
            b, i = parts[a]
            plgpu.copy_gmem_to_smem(plan.rows(q_ref, b, q_span(i), n, Q), q_smem.at[a], q_bar.at[a])
        for a in mine(c):
            plgpu.barrier_wait(q_bar.at[a])
        schedule.first(c)
        acc = ops.zeros((plan.block_q, plan.value_dim))
        carry = acc, ops.zeros((plan.block_q,), 1, -jnp.inf), ops.zeros((plan.block_q,), 1)
        return (carry,) * len(mine(c))

    def part_step(c, a, r, j, slot, carry):
        acc, m_prev, l_prev = carry
        _, _, _, parts, st = item(r)
        s = ops.dot(
            q_smem.at[a], k_bufs[row_of(a)].at[slot], trans_b=True,
            issued=lambda: schedule.hand_over(c),
        )  # fmt: skip
        biases = [
            widen(plan, buf.at[slot], shape)
            for buf, shape in zip(bias_slots[a], plan.bias_shapes, strict=True)
        ]
        mask = mask_slots[a]
        mask = None if mask is None else widen(plan, mask.at[slot], plan.mask_shape)
        s, _ = logits(plan, s, biases, mask, st, parts[a][1], j)
        m = jnp.maximum(m_prev, jnp.max(s, axis=1))
        correction = jnp.exp2((m_prev - m) * LOG2E)
        p = weights(s, m, 0)
        acc = acc * lax.broadcast_in_dim(correction, acc.shape, (0,))
        v_slot = v_bufs[row_of(a)].at[slot]
        if plan.live:  # both consumers zero the same dead rows: the same zeros written twice
            zero_dead_rows(plan, v_slot, live_bufs[row_of(a)].at[slot])
        schedule.wait_turn(c)
        acc = ops.dot(lhs_operand(plan, p, stagings[c]), v_slot, trans_b=plan.tf32, acc=acc)
        return acc, m, l_prev * correction + jnp.sum(p, axis=1)

    def step(c, r, j, slot, carries):
        return tuple(part_step(c, a, r, j, slot, x) for a, x in zip(mine(c), carries, strict=True))

    def end(c, r, carries):
        _, _, n, parts, st = item(r)
        schedule.last(c)
        for a, (acc, m, total) in zip(mine(c), carries, strict=True):
            if st is not None:  # a row whose every key block was skipped: 0 and a finite lse
                seen = total > 0
                total = jnp.where(seen, total, 1.0)
                m = jnp.where(seen, m, numerics.MASK_VALUE)
            out = (acc / lax.broadcast_in_dim(total, acc.shape, (0,))).astype(o_smem.dtype)
            o_smem.at[a][...] = out
            lse_smem.at[a][...] = m + jnp.log(total)
        plgpu.commit_smem()
        for a in mine(c):
            b, i = parts[a]
            plgpu.copy_smem_to_gmem(o_smem.at[a], plan.rows(o_ref, b, q_span(i), n))
            plgpu.copy_smem_to_gmem(lse_smem.at[a], lse_ref.at[b, n, q_span(i)])
        plgpu.wait_smem_to_gmem(0)

    span = lambda r: _key_span(plan, item(r).st, item(r).blocks)  # noqa: E731
    pipeline(plan, _items(plan, lse_ref.shape[0]), span, streams, consumed, begin, step, end)


def forward_scratch(plan: Plan) -> list:
    """The forward kernel's shared memory and barriers, in the order it unpacks them: the parts'
    (Plan.parts) q, output and lse tiles, each consumer's staging tile (float32), then per row
    its k and v slots, then the biases' and mask's slots (pair_scratch: once for the parts that
    share a tile) and per row the live keys'."""
    _, plgpu = modules()
    cdt = jnp.dtype(plan.compute_dtype)
    per, cons, parts = plan.rows_per_program, plan.consumer_warpgroups, plan.parts
    rows = []
    for _ in range(per):
        rows += [
            plan.smem((DEPTH, plan.block_k, plan.head_dim), cdt, operand=True),
            plgpu.Barrier(num_barriers=DEPTH),
            plan.smem(kv_tile(plan, plan.value_dim), cdt, operand=True),
            plgpu.Barrier(num_barriers=DEPTH),
        ]
    return [
        plan.smem((parts, plan.block_q, plan.head_dim), cdt, operand=True),
        plgpu.Barrier(num_barriers=parts),
        plgpu.Barrier(num_arrivals=cons, num_barriers=DEPTH),  # consumed: by every consumer
        plan.smem((parts, plan.block_q, plan.value_dim), cdt, operand=True),
        plan.smem((parts, plan.block_q), jnp.float32),
        *staging_scratch(plan, plan.block_q, plan.block_k) * cons,
        *rows,
        *pair_scratch(plan, parts=parts),
        *(live_scratch(plan, plan.block_k) * per),
    ]


def forward(plan: Plan, q, k, v, biases, extras):
    """(out [B, Tp, N, Dv] ([Tp, B, N, Dv] with Plan.columns) in the compute dtype, lse
    [B, N, Tp] float32) of padded inputs."""
    batch, heads, cdt = q.shape[1 if plan.columns else 0], plan.heads, jnp.dtype(plan.compute_dtype)
    perm = (1, 2, 3, 0) if plan.columns else (0, 2, 3, 1)  # v transposed: [B, K, Dv, S]
    v_op = jnp.transpose(v, perm) if plan.tf32 else v
    rows = (plan.q_pad, batch) if plan.columns else (batch, plan.q_pad)
    out_type = (
        jax.ShapeDtypeStruct((*rows, heads, plan.value_dim), cdt),
        jax.ShapeDtypeStruct((batch, heads, plan.q_pad), jnp.float32),
    )
    grid = (plan.programs,) if plan.programs else plan.tiles(batch)
    return plan.launch(
        _forward_kernel,
        grid,
        ("t",) if plan.programs else ("b", "n", "i"),
        out_type,
        forward_scratch(plan),
        (q, k, v_op, *biases, *extras),
        "gated_attention_mosaic_forward",
    )
