"""The one-pass backward of the Pallas GPU kernels (PallasAttention.fused_backward): one kernel
that computes each tile's p and ds once and takes all three gradients from them, where the
two-kernel backward (attention/pallas_triton/kernels.py) recomputes both in each kernel.

One program per (group of batch rows, key/value head, block of keys) loops over its rows, the
group's query heads and the query blocks, as the dk/dv kernel does. Its dk and dv stay in
registers; dq is a sum over key blocks that other programs hold, so each program stores its
block's float32 partial ds @ k into its own slice of a [key blocks x B, T, N, H] buffer and XLA
sums the slices afterwards: no atomics, deterministic, at the cost of that buffer (key blocks
times q's size in float32). The bias gradients are read-modify-written in the program's own
tiles, per group for a bias shared over the batch, as the dq kernel's are.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from gated_attention.attention.gpu_common import softmax_delta, sum_bias_partials
from gated_attention.attention.pallas_triton.kernels import (
    Q,
    _dot,
    _lengths,
    _Tiles,
    accumulate_bias_grad,
    bias_grad_buffers,
    key_block_grads,
    store_dkdv,
)
from gated_attention.attention.pallas_triton.plan import Plan
from gated_attention.attention.pallas_triton.plan import pallas_modules as _pallas
from gated_attention.attention.pallas_triton.tile_table import MIN_TILE, _pow2_tile


def _fused_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, tiles: _Tiles, shapes: tuple
):
    """dk, dv of key block j of head kv for each row of group g; that block's dq partial of each
    of those rows' query blocks; the bias-gradient tiles (group or row, head, all queries, key
    block j) it owns."""
    pl, _ = _pallas()
    plan = tiles.plan
    batch = tiles.batch
    bias_refs, extras, rest = tiles.split(refs)
    rest = rest[len(shapes) :]  # the zero-filled bias-gradient buffers aliased to the outputs
    outs = 1 if plan.packed else 2
    dk_ref, dv_ref = rest[:outs] * (2 if plan.packed else 1)  # packed: one [B, S, 3, K, D]
    dq_ref, dbias_refs = rest[outs], rest[outs + 1 :]
    g, kv, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    k_span = tiles.span(j, plan.block_k, tiles.k_len)
    operands = (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref)
    q_blocks = -(-tiles.q_len // plan.block_q)
    dq_width = _pow2_tile(plan.head_dim)

    def store_dq(b, n, q_span, dq):  # row j * B + b of the partials: key block j's slice
        tiles.store_rows(dq_ref, j * batch + b, q_span, n, plan.head_dim, dq)

    def row(r, carry):
        b = g + plan.row_groups * r

        def each_tile(n, i, q_span, live_q, k, ds):  # key block j's share of dq; the biases'
            dq = _dot(ds.astype(k.dtype), k, precision=plan.precision) * plan.scale
            if live_q is not None:
                dq = jnp.where(live_q[:, None] != 0, dq, 0.0)
            store_dq(b, n, q_span, dq)
            for ref, shape in zip(dbias_refs, shapes, strict=True):
                slot = b if shape[0] > 1 else g
                accumulate_bias_grad(ref, shape, slot, n, q_span, i, k_span, j, ds)

        def each_head(n, lo, hi):  # query blocks the structure skips: their dq partial is 0
            if extras.meta is None:
                return

            def zero(i, carry):
                q_span = tiles.span(i, plan.block_q, tiles.q_len)
                store_dq(b, n, q_span, jnp.zeros((plan.block_q, dq_width), jnp.float32))
                return carry

            lax.fori_loop(0, lo, zero, 0)
            lax.fori_loop(hi, q_blocks, zero, 0)

        dk, dv, seen = key_block_grads(
            tiles, operands, bias_refs, extras, b, kv, j, k_span, each_tile, each_head
        )
        store_dkdv(tiles, dk_ref, dv_ref, b, k_span, kv, dk, dv, seen)
        return carry

    rows = (batch - g + plan.row_groups - 1) // plan.row_groups  # rows g, g + groups, ... < batch
    lax.fori_loop(0, rows, row, 0)


def fused_plan(plan: Plan) -> Plan:
    """The plan the fused kernel runs: its dk and dv accumulators live beside each tile's p, ds
    and dq partial, so it takes fewer queries a tile than the forward (at least MIN_TILE): half
    of them and 8 warps in half precision, a quarter in float32. At the forward's tiles it
    spilled in 44 of 180 forms compiled for an H100; so, in none of the 120 half-precision forms
    on an A100, H100, B200, RTX 4090 or RTX PRO 6000, and with 16.20 instructions a score
    against 18.25 at AF2's MSA row (a quarter in half precision: 25.56, the small tiles' mma
    sync). float32 still spills on the A100, Ada and sm_120 at head dims <= 16
    (benchmark_results/gpu_kernels/fused_backward/)."""
    half = jnp.dtype(plan.compute_dtype).itemsize == 2
    block_q = max(MIN_TILE, plan.block_q // (2 if half else 4))
    return dataclasses.replace(plan, block_q=block_q, num_warps=8 if half else plan.num_warps)


def backward(plan: Plan, residuals, cotangents):
    """(dq, dk, dv, dbiases, None per extra) of the custom VJP, by the one fused kernel."""
    plan = fused_plan(plan)
    q, k, v, biases, extras, out, lse = residuals
    d_out, d_lse = cotangents
    batch, q_len, k_len = _lengths(plan, q, k)
    heads = q.shape[-2]
    k_blocks = -(-k_len // plan.block_k)
    tiles = _Tiles(plan, batch, q_len, k_len, len(biases))
    delta = softmax_delta(out, d_out, d_lse, plan.columns)  # [B, N, T]
    common = (q, k, v, d_out, lse, delta, *biases, *extras)
    shapes = tuple(tuple(b.shape) for b in biases)
    buffers = bias_grad_buffers(plan, shapes, batch, heads, q_len, k_len, k_blocks)
    dkdv_shapes = (k, v) if not plan.packed else (q,)  # packed: slots 1 and 2 of one array
    # dq's partials, one slice of B rows per key block, unpacked: [k_blocks * B, T, N, H]
    # ([T, k_blocks * B, N, H] positions first).
    one = (*q.shape[:2], *q.shape[-2:])
    lead = (one[0], k_blocks * one[1]) if plan.columns else (k_blocks * one[0], one[1])
    outs = (
        *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in dkdv_shapes),
        jax.ShapeDtypeStruct((*lead, *one[2:]), jnp.float32),
        *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in buffers),
    )
    first, after = len(common), len(dkdv_shapes) + 1
    results = plan.call(
        functools.partial(_fused_kernel, tiles=tiles, shapes=shapes),
        (plan.row_groups, plan.kv_heads, k_blocks),
        outs,
        (*common, *buffers),
        "gated_attention_fused_backward",
        aliases={first + t: after + t for t in range(len(buffers))},
    )
    dkdv, parts, partials = results[: after - 1], results[after - 1], results[after:]
    if plan.columns:  # [T, k_blocks, B, N, H]
        dq = jnp.sum(parts.reshape(one[0], k_blocks, *one[1:]), axis=1)
    else:
        dq = jnp.sum(parts.reshape(k_blocks, *one), axis=0)
    dq = dq.astype(q.dtype)
    dbiases, none = sum_bias_partials(biases, partials), tuple(None for _ in extras)
    if plan.packed:  # dq into slot 0 of the packed gradient the kernel wrote dk, dv into
        return dkdv[0].at[:, :, Q].set(dq), None, None, dbiases, none
    dk, dv = dkdv
    return dq, dk, dv, dbiases, none
