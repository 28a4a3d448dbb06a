"""The Mosaic GPU forward kernel (attention/pallas_mosaic_gpu/implementation.py's docstring: grid, numerics), its
shared-memory scratch and launch: one program per (batch rows, head, query blocks), the online
softmax over the key blocks the pipeline (attention/pallas_mosaic_gpu/pipeline.py) streams.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from gated_attention.attention.gpu_common import LOG2E
from gated_attention.attention.pallas_mosaic_gpu.pipeline import (
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


def _forward_kernel(*refs, plan: Plan):
    """Batch rows g * R .. g * R + R - 1 (R = Plan.rows_per_program; in the last group, rows
    past the batch repeat its last row: the same values stored twice) of head n, query block i.
    Each key block's step streams every row's k and v tiles, and the tile of a bias or mask
    shared over the batch once for all R rows."""
    pl, plgpu = modules()
    ops = plan.ops
    per = plan.rows_per_program
    front, bias_refs, mask_ref, (_, live_k_ref), meta_ref, refs = split_refs(plan, refs, 3)
    q_ref, k_ref, v_ref = front
    o_ref, lse_ref = refs.pop(0), refs.pop(0)
    q_smem, q_bar, consumed, o_smem, lse_smem, *scratch = refs
    staging = scratch.pop(0) if jnp.dtype(plan.compute_dtype) == jnp.float32 else None
    g, n, i = lax.axis_index("b"), lax.axis_index("n"), lax.axis_index("i")
    last = lse_ref.shape[0] - 1
    rows = [g] if per == 1 else [jnp.minimum(g * per + r, last) for r in range(per)]
    kv = lax.div(n, jnp.int32(plan.q_heads_per_kv_head))
    st = row_structure(meta_ref, rows[0])  # several rows only without a structure (Plan.make)
    lo, hi = key_blocks(plan, st, i)
    q_span = pl.ds(i * plan.block_q, plan.block_q)
    streams, k_bufs, v_bufs = row_streams(plan, rows, kv, k_ref, v_ref, scratch)
    live_bufs = []
    pair, bias_slots, mask_slots = row_pair_streams(plan, bias_refs, mask_ref, scratch, rows, n, i)
    streams += pair
    if plan.live:  # keys no query of head n sees: zeroed in v before p @ v
        for b in rows:
            live_buf, live_bar = scratch.pop(0), scratch.pop(0)
            source = vector_source(plan, live_k_ref, lambda r, b=b: b, lambda r: n,
                                    lambda r, j: j, plan.block_k)  # fmt: skip
            streams.append(Stream(source, live_buf, live_bar))
            live_bufs.append(live_buf)

    def begin(r):
        for c, b in enumerate(rows):
            plgpu.copy_gmem_to_smem(plan.rows(q_ref, b, q_span, n, Q), q_smem.at[c], q_bar.at[c])
        for c in range(per):
            plgpu.barrier_wait(q_bar.at[c])
        acc = ops.zeros((plan.block_q, plan.value_dim))
        carry = acc, ops.zeros((plan.block_q,), 1, -jnp.inf), ops.zeros((plan.block_q,), 1)
        return (carry,) * per

    def row_step(c, j, slot, carry):
        acc, m_prev, l_prev = carry
        s = ops.dot(q_smem.at[c], k_bufs[c].at[slot], trans_b=True)
        biases = [
            widen(plan, buf.at[slot], shape)
            for buf, shape in zip(bias_slots[c], plan.bias_shapes, strict=True)
        ]
        mask = mask_slots[c]
        mask = None if mask is None else widen(plan, mask.at[slot], plan.mask_shape)
        s, _ = logits(plan, s, biases, mask, st, i, j)
        m = jnp.maximum(m_prev, jnp.max(s, axis=1))
        correction = jnp.exp2((m_prev - m) * LOG2E)
        p = weights(s, m, 0)
        acc = acc * lax.broadcast_in_dim(correction, acc.shape, (0,))
        v_slot = v_bufs[c].at[slot]
        if plan.live:
            zero_dead_rows(plan, v_slot, live_bufs[c].at[slot])
        acc = ops.dot(lhs_operand(plan, p, staging), v_slot, trans_b=plan.tf32, acc=acc)
        return acc, m, l_prev * correction + jnp.sum(p, axis=1)

    def step(r, j, slot, carries):
        return tuple(row_step(c, j, slot, carry) for c, carry in enumerate(carries))

    def end(r, carries):
        for c, (acc, m, total) in enumerate(carries):
            if st is not None:  # a row whose every key block was skipped: 0 and a finite lse
                seen = total > 0
                total = jnp.where(seen, total, 1.0)
                m = jnp.where(seen, m, numerics.MASK_VALUE)
            out = (acc / lax.broadcast_in_dim(total, acc.shape, (0,))).astype(o_smem.dtype)
            o_smem.at[c][...] = out
            lse_smem.at[c][...] = m + jnp.log(total)
        plgpu.commit_smem()
        for c, b in enumerate(rows):
            plgpu.copy_smem_to_gmem(o_smem.at[c], plan.rows(o_ref, b, q_span, n))
            plgpu.copy_smem_to_gmem(lse_smem.at[c], lse_ref.at[b, n, q_span])
        plgpu.wait_smem_to_gmem(0)

    pipeline(plan, 1, lambda r: (lo, hi), streams, consumed, begin, step, end)


def forward_scratch(plan: Plan) -> list:
    """The forward kernel's shared memory and barriers, in the order it unpacks them: the R =
    Plan.rows_per_program rows' q, output and lse tiles, then per row its k and v slots, then
    the biases' and mask's slots (pair_scratch: shared over the batch once) and per row the
    live keys'."""
    _, plgpu = modules()
    cdt = jnp.dtype(plan.compute_dtype)
    per = plan.rows_per_program
    rows = []
    for _ in range(per):
        rows += [
            plan.smem((DEPTH, plan.block_k, plan.head_dim), cdt, operand=True),
            plgpu.Barrier(num_barriers=DEPTH),
            plan.smem(kv_tile(plan, plan.value_dim), cdt, operand=True),
            plgpu.Barrier(num_barriers=DEPTH),
        ]
    return [
        plan.smem((per, plan.block_q, plan.head_dim), cdt, operand=True),
        plgpu.Barrier(num_barriers=per),
        plgpu.Barrier(num_barriers=DEPTH),  # consumed
        plan.smem((per, plan.block_q, plan.value_dim), cdt, operand=True),
        plan.smem((per, plan.block_q), jnp.float32),
        *staging_scratch(plan, plan.block_q, plan.block_k),
        *rows,
        *pair_scratch(plan, rows=per),
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
    groups = -(-batch // plan.rows_per_program)  # the last group's rows clamped to the batch
    return plan.launch(
        _forward_kernel,
        (groups, heads, plan.q_blocks),
        ("b", "n", "i"),
        out_type,
        forward_scratch(plan),
        (q, k, v_op, *biases, *extras),
        "gated_attention_mosaic_forward",
    )
