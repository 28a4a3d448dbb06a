"""The Mosaic GPU backward kernels (attention/pallas_mosaic_gpu/implementation.py's docstring: grids, numerics): the dk/dv
kernel and the dq/bias-gradient kernel with their shared-memory scratch and launches, and the
forward/backward pair attention/pallas_mosaic_gpu/implementation.py makes a custom VJP of (the forward kernel:
attention/pallas_mosaic_gpu/kernels_sm90_forward.py); on pipeline.py's pipeline and tiles.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from gated_attention.attention import base
from gated_attention.attention.gpu_common import softmax_delta, sum_bias_partials
from gated_attention.attention.pallas_mosaic_gpu.kernels_sm90_forward import (
    forward_scratch,
    weights,
)
from gated_attention.attention.pallas_mosaic_gpu.pipeline import (
    Stream,
    key_blocks,
    lhs_operand,
    live_scratch,
    logits,
    pair_scratch,
    pair_streams,
    pipeline,
    query_blocks,
    row_structure,
    split_refs,
    staging_scratch,
    vector_source,
    widen,
    zero_dead_rows,
)
from gated_attention.attention.pallas_mosaic_gpu.plan import (
    DEPTH,
    K,
    Plan,
    Q,
    V,
    broadcast_form,
    modules,
)


def _bytes(scratch) -> int:
    return sum(
        math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
        for x in scratch
        if hasattr(x, "dtype") and hasattr(x, "shape")
    )


REDUCTION_SCRATCH = 128 * 4 * 4  # Mosaic GPU's CompilerParams.reduction_scratch_bytes default


def _bound(scratch) -> int:
    """_bytes with each buffer rounded up to 1 KiB, 8 B a barrier and Mosaic GPU's reduction
    scratch: what a float32 two-consumer forward's compile took, to the byte (233,616)."""
    barriers = sum(math.prod(x.num_barriers) for x in scratch if hasattr(x, "num_arrivals"))
    padded = sum(-(-_bytes([x]) // 1024) * 1024 for x in scratch)
    return padded + 8 * barriers + REDUCTION_SCRATCH


def shared_memory_bytes(plan: Plan) -> int:
    """The most shared memory one of the three kernels' blocks takes (barriers aside; the
    two-consumer forward's _bound: its plain sum was 3,216 B short of a float32 compile's)."""
    back = plan.with_one_consumer()  # the plan backward() runs them with
    forward = (_bytes if plan.consumer_warpgroups == 1 else _bound)(forward_scratch(plan))
    return max(forward, _bytes(dkdv_scratch(back)), _bytes(dq_scratch(back)))


def forward_bytes(plan: Plan) -> int:
    """The forward kernel's shared memory (barriers aside)."""
    return _bytes(forward_scratch(plan))


def _load_whole(copies, barriers):
    """Copies each (global slice, shared-memory tile) of `copies` on its barrier k, then waits
    for them all: the tiles the consumer holds across a row's steps, outside the streams."""
    _, plgpu = modules()
    for k, (src, dst) in enumerate(copies):
        plgpu.copy_gmem_to_smem(src, dst, barriers.at[k])
    for k in range(len(copies)):
        plgpu.barrier_wait(barriers.at[k])


def _slot_logits(plan: Plan, s, bias_slots, mask_slots, slot, st, i, j, transposed=False):
    """logits() of the product s with the slot's bias and mask tiles widened to its shape."""
    biases = [
        widen(plan, buf.at[slot], shape, transposed=transposed)
        for buf, shape in zip(bias_slots, plan.bias_shapes, strict=True)
    ]
    mask = None
    if mask_slots is not None:
        mask = widen(plan, mask_slots.at[slot], plan.mask_shape, transposed=transposed)
    return logits(plan, s, biases, mask, st, i, j, transposed=transposed)


def _p_and_ds(plan: Plan, s, cap_grad, lse_ref, delta_ref, do_ref, v_ref, transposed=False):
    """Recomputes p = exp(s - lse) of a tile of logits and ds = p * (dp - delta), times the soft
    cap's derivative, with dp = do @ v.T ([bq, bk]; transposed: v @ do.T [bk, bq])."""
    ops = plan.ops
    q_axis = 1 if transposed else 0
    lse = ops.load(lse_ref, axis=1 - q_axis)
    p = weights(s, lse, q_axis)
    lhs, rhs = (v_ref, do_ref) if transposed else (do_ref, v_ref)
    dp = ops.dot(lhs, rhs, trans_b=True)
    delta = ops.load(delta_ref, axis=1 - q_axis)
    ds = p * (dp - lax.broadcast_in_dim(delta, s.shape, (q_axis,)))
    if cap_grad is not None:
        ds = ds * cap_grad
    return p, ds


def _grad_dot(plan: Plan, x, staging, bufs, transposed_bufs, slot, acc):
    """acc + x @ bufs[slot], x (p or ds) in registers the left operand; in float32 against the
    slot of the operand's transposed copy (TF32 wgmma reads both operands K-major)."""
    if plan.tf32:
        return plan.ops.dot(
            lhs_operand(plan, x, staging), transposed_bufs.at[slot], trans_b=True, acc=acc
        )
    return plan.ops.dot(lhs_operand(plan, x, None), bufs.at[slot], acc=acc)


def _dkdv_kernel(*refs, plan: Plan):
    """dk, dv of key block j of key/value head kv, summed over the group's query heads, in the
    transposed orientation (s.T = k @ q.T [bk, bq]) so that p.T and ds.T are left operands."""
    pl, plgpu = modules()
    ops = plan.ops
    front, bias_refs, mask_ref, live_refs, meta_ref, rest = split_refs(
        plan, refs, 8 if plan.tf32 else 6
    )
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *transposed = front
    qt_ref, dot_ref = transposed if plan.tf32 else (None, None)
    dk_ref, dv_ref, *scratch = rest
    k_smem, v_smem, kv_bar, q_buf, q_bar, do_buf, do_bar, lse_buf, lse_bar = scratch[:9]
    delta_buf, delta_bar, consumed, dk_smem, dv_smem = scratch[9:14]
    scratch = scratch[14:]
    qt_buf, qt_bar, dot_buf, dot_bar = scratch[:4] if plan.tf32 else (None,) * 4
    scratch = scratch[4:] if plan.tf32 else scratch
    staging = scratch.pop(0) if plan.tf32 else None
    b, kv, j = lax.axis_index("b"), lax.axis_index("n"), lax.axis_index("j")
    st = row_structure(meta_ref, b)
    lo, hi = query_blocks(plan, st, j)
    head = lambda r: kv * plan.q_heads_per_kv_head + r  # noqa: E731
    ks = pl.ds(j * plan.block_k, plan.block_k)
    qs = lambda i: pl.ds(i * plan.block_q, plan.block_q)  # noqa: E731
    streams = [
        Stream(lambda r, i: plan.rows(q_ref, b, qs(i), head(r), Q), q_buf, q_bar),
        Stream(lambda r, i: plan.rows(do_ref, b, qs(i), head(r)), do_buf, do_bar),
        Stream(lambda r, i: lse_ref.at[b, head(r), qs(i)], lse_buf, lse_bar),
        Stream(lambda r, i: delta_ref.at[b, head(r), qs(i)], delta_buf, delta_bar),
    ]
    if plan.tf32:
        streams += [
            Stream(lambda r, i: qt_ref.at[b, head(r), :, qs(i)], qt_buf, qt_bar),
            Stream(lambda r, i: dot_ref.at[b, head(r), :, qs(i)], dot_buf, dot_bar),
        ]
    pair, bias_slots, mask_slots = pair_streams(
        plan, bias_refs, mask_ref, scratch, lambda r: b, head, lambda r, i: i, lambda r, i: j,
        transposed=True,
    )  # fmt: skip
    streams += pair
    if plan.live:  # queries of head(r) with no key: zeroed in q before ds.T @ q
        live_buf, live_bar = scratch[-2:]
        source = vector_source(plan, live_refs[0], lambda r: b, head, lambda r, i: i,
                                plan.block_q)  # fmt: skip
        streams.append(Stream(source, live_buf, live_bar))

    @pl.when(lax.axis_index("wg") == 0)
    def _():
        tiles = [(plan.rows(k_ref, b, ks, kv, K), k_smem), (plan.rows(v_ref, b, ks, kv, V), v_smem)]
        _load_whole(tiles, kv_bar)

    def begin(c, r):  # one consumer: c is 0
        return ops.zeros((plan.block_k, plan.head_dim)), ops.zeros((plan.block_k, plan.value_dim))

    def step(c, r, i, slot, carry):
        dk, dv = carry
        st_ = ops.dot(k_smem, q_buf.at[slot], trans_b=True)  # [bk, bq]
        s, cap_grad = _slot_logits(
            plan, st_, bias_slots, mask_slots, slot, st, i, j, transposed=True
        )
        p, ds = _p_and_ds(plan, s, cap_grad, lse_buf.at[slot], delta_buf.at[slot],
                          do_buf.at[slot], v_smem, transposed=True)  # fmt: skip
        if plan.live:
            zero_dead_rows(plan, q_buf.at[slot], live_buf.at[slot])
        dv = _grad_dot(plan, p, staging, do_buf, dot_buf, slot, dv)
        dk = _grad_dot(plan, ds, staging, q_buf, qt_buf, slot, dk)
        return dk, dv

    def end(c, r, carry):  # after the group's last head: the accumulators span the group
        dk, dv = carry
        dk_smem[...] = (dk * plan.scale).astype(dk_smem.dtype)
        dv_smem[...] = dv.astype(dv_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(dk_smem, plan.rows(dk_ref, b, ks, kv))
        plgpu.copy_smem_to_gmem(dv_smem, plan.rows(dv_ref, b, ks, kv))
        plgpu.wait_smem_to_gmem(0)

    pipeline(plan, plan.q_heads_per_kv_head, lambda r: (lo, hi), streams, consumed, begin, step, end,
              carry_rows=True)  # fmt: skip


def dbias_shape(plan: Plan, shape, batch: int):
    """The float32 buffer of one bias's gradient: [B or groups, N, Tp (or query blocks for a
    bias without T), Sp or 1]; XLA sums it to the bias's shape afterwards."""
    slots = batch if shape[0] > 1 else plan.row_groups
    return (
        slots,
        plan.heads,
        plan.q_pad if shape[2] > 1 else plan.q_blocks,
        plan.k_pad if shape[3] > 1 else 1,
    )


def _dbias_tiles(plan: Plan, dbias_refs, g, n, i, qs, ks):
    """tile(t, b, j): the slice of bias gradient t's buffer that program (g, n, i) owns for batch
    row b and key block j (a bias shared over the batch: its group g's)."""

    def tile(t, b, j):
        shape, ref = plan.bias_shapes[t], dbias_refs[t]
        slot = b if shape[0] > 1 else g
        form = broadcast_form(shape)
        if form == "tile":
            return ref.at[slot, n, qs, ks(j)]
        return ref.at[slot, n, i, ks(j)] if form == "keys" else ref.at[slot, n, qs, 0]

    return tile


def _zero_dbias(plan: Plan, rmw, tile, r, b):
    """Zeroes this program's tiles of each bias gradient for row r (batch row b), before the
    first add to them: a shared bias's once per group, at its first row."""
    pl, plgpu = modules()
    ops = plan.ops
    for t, (smem, _) in enumerate(rmw):
        shared = plan.bias_shapes[t][0] == 1

        @pl.when(jnp.logical_or(not shared, r == 0))
        def _(t=t, smem=smem):
            form = broadcast_form(plan.bias_shapes[t])
            smem[...] = ops.zeros(smem.shape, {"tile": None, "keys": 0, "queries": 1}[form])
            plgpu.commit_smem()
            blocks = 1 if form == "queries" else plan.k_blocks

            @pl.loop(0, blocks)
            def _(j):
                plgpu.copy_smem_to_gmem(smem, tile(t, b, j))

            plgpu.wait_smem_to_gmem(0)


def _accumulate_dbias(plan: Plan, rmw, tile, b, j, ds):
    """Adds ds into this program's tile of each bias gradient for batch row b, key block j, by a
    read-modify-write through shared memory in the steps' order (deterministic, no atomics)."""
    _, plgpu = modules()
    ops = plan.ops
    for t, (smem, bar) in enumerate(rmw):
        form = broadcast_form(plan.bias_shapes[t])
        view = tile(t, b, j)
        plgpu.copy_gmem_to_smem(view, smem, bar.at[0])
        plgpu.barrier_wait(bar.at[0])
        if form == "tile":
            part, axis = ds, None
        else:  # a vector: the sum over the bias's broadcast dim
            axis = 0 if form == "keys" else 1
            part = jnp.sum(ds, axis=axis)
        smem[...] = ops.load(smem, axis) + part
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem, view)
        plgpu.wait_smem_to_gmem(0)


def _dq_dbias_kernel(*refs, plan: Plan, batch: int):
    """dq of query block i of head n for each batch row g, g + groups, ...; and the bias
    gradients of those rows (summed per group for a bias shared over the batch) by
    read-modify-write of this program's own tiles, so no two programs touch one tile."""
    pl, plgpu = modules()
    ops = plan.ops
    front, bias_refs, mask_ref, live_refs, meta_ref, rest = split_refs(
        plan, refs, 7 if plan.tf32 else 6
    )
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *transposed = front
    kt_ref = transposed[0] if plan.tf32 else None
    n_bias = len(plan.bias_shapes)
    dq_ref, dbias_refs, scratch = rest[0], rest[1 : 1 + n_bias], list(rest[1 + n_bias :])
    q_smem, do_smem, lse_smem, delta_smem, row_bar = scratch[:5]
    k_buf, k_bar, v_buf, v_bar, consumed, dq_smem = scratch[5:11]
    scratch = scratch[11:]
    kt_buf, kt_bar = (scratch.pop(0), scratch.pop(0)) if plan.tf32 else (None, None)
    staging = scratch.pop(0) if plan.tf32 else None
    rmw = [(scratch.pop(0), scratch.pop(0)) for _ in range(n_bias)]  # (smem, barrier)
    g, n, i = lax.axis_index("g"), lax.axis_index("n"), lax.axis_index("i")
    kv = lax.div(n, jnp.int32(plan.q_heads_per_kv_head))
    b_of = lambda r: g + plan.row_groups * r  # noqa: E731
    qs = pl.ds(i * plan.block_q, plan.block_q)
    ks = lambda j: pl.ds(j * plan.block_k, plan.block_k)  # noqa: E731
    streams = [
        Stream(lambda r, j: plan.rows(k_ref, b_of(r), ks(j), kv, K), k_buf, k_bar),
        Stream(lambda r, j: plan.rows(v_ref, b_of(r), ks(j), kv, V), v_buf, v_bar),
    ]
    if plan.tf32:
        streams.append(Stream(lambda r, j: kt_ref.at[b_of(r), kv, :, ks(j)], kt_buf, kt_bar))
    pair, bias_slots, mask_slots = pair_streams(
        plan, bias_refs, mask_ref, scratch, b_of, lambda r: n, lambda r, j: i, lambda r, j: j
    )
    streams += pair
    if plan.live:  # keys no query of head n sees: zeroed in k and v before ds @ k, do @ v.T
        live_buf, live_bar = scratch[-2:]
        source = vector_source(plan, live_refs[1], b_of, lambda r: n, lambda r, j: j,
                                plan.block_k)  # fmt: skip
        streams.append(Stream(source, live_buf, live_bar))
    dbias_tile = _dbias_tiles(plan, dbias_refs, g, n, i, qs, ks)

    def begin(c, r):  # one consumer: c is 0
        b = b_of(r)
        tiles = [(plan.rows(q_ref, b, qs, n, Q), q_smem), (plan.rows(do_ref, b, qs, n), do_smem)]
        tiles += [(lse_ref.at[b, n, qs], lse_smem), (delta_ref.at[b, n, qs], delta_smem)]
        _load_whole(tiles, row_bar)
        _zero_dbias(plan, rmw, dbias_tile, r, b)
        return ops.zeros((plan.block_q, plan.head_dim))

    def step(c, r, j, slot, dq):
        b = b_of(r)
        st = row_structure(meta_ref, b)
        if plan.live:
            zero_dead_rows(plan, k_buf.at[slot], live_buf.at[slot])
            zero_dead_rows(plan, v_buf.at[slot], live_buf.at[slot])
        s = ops.dot(q_smem, k_buf.at[slot], trans_b=True)
        s, cap_grad = _slot_logits(plan, s, bias_slots, mask_slots, slot, st, i, j)
        _, ds = _p_and_ds(plan, s, cap_grad, lse_smem, delta_smem, do_smem, v_buf.at[slot])
        _accumulate_dbias(plan, rmw, dbias_tile, b, j, ds)
        return _grad_dot(plan, ds, staging, k_buf, kt_buf, slot, dq)

    def end(c, r, dq):
        dq_smem[...] = (dq * plan.scale).astype(dq_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(dq_smem, plan.rows(dq_ref, b_of(r), qs, n))
        plgpu.wait_smem_to_gmem(0)

    def span(r):
        return key_blocks(plan, row_structure(meta_ref, b_of(r)), i)

    rows = lax.div(batch - g + plan.row_groups - 1, jnp.int32(plan.row_groups))
    pipeline(plan, rows, span, streams, consumed, begin, step, end)


def _scratch_kit(plan: Plan):
    _, plgpu = modules()
    cdt = jnp.dtype(plan.compute_dtype)
    operand = lambda shape, dtype=cdt: plan.smem(shape, dtype, operand=True)  # noqa: E731
    barrier = lambda n=DEPTH: plgpu.Barrier(num_barriers=n)  # noqa: E731
    return cdt, operand, barrier


def dkdv_scratch(plan: Plan) -> list:
    """The dk/dv kernel's shared memory and barriers, in the order it unpacks them."""
    cdt, operand, barrier = _scratch_kit(plan)
    q_tile = lambda w: operand((DEPTH, plan.block_q, w))  # noqa: E731
    scratch = [
        operand((plan.block_k, plan.head_dim)),
        operand((plan.block_k, plan.value_dim)),
        barrier(2),
        q_tile(plan.head_dim), barrier(),
        q_tile(plan.value_dim), barrier(),
        plan.smem((DEPTH, plan.block_q), jnp.float32), barrier(),
        plan.smem((DEPTH, plan.block_q), jnp.float32), barrier(),
        barrier(),  # consumed
        operand((plan.block_k, plan.head_dim)),
        operand((plan.block_k, plan.value_dim)),
    ]  # fmt: skip
    if plan.tf32:
        for w in (plan.head_dim, plan.value_dim):
            scratch += [operand((DEPTH, w, plan.block_q)), barrier()]
    scratch += staging_scratch(plan, plan.block_k, plan.block_q) + pair_scratch(plan, True)
    return scratch + live_scratch(plan, plan.block_q)


def dq_scratch(plan: Plan) -> list:
    """The dq/bias-gradient kernel's shared memory and barriers, in the order it unpacks them."""
    cdt, operand, barrier = _scratch_kit(plan)
    rmw = []
    for shape in plan.bias_shapes:
        form = broadcast_form(shape)
        if form == "tile":
            rmw += [operand((plan.block_q, plan.block_k), jnp.float32), barrier(1)]
        else:
            size = plan.block_k if form == "keys" else plan.block_q
            rmw += [plan.smem((size,), jnp.float32), barrier(1)]
    scratch = [
        operand((plan.block_q, plan.head_dim)),
        operand((plan.block_q, plan.value_dim)),
        plan.smem((plan.block_q,), jnp.float32),
        plan.smem((plan.block_q,), jnp.float32),
        barrier(4),
        operand((DEPTH, plan.block_k, plan.head_dim)), barrier(),
        operand((DEPTH, plan.block_k, plan.value_dim)), barrier(),
        barrier(),  # consumed
        operand((plan.block_q, plan.head_dim)),
    ]  # fmt: skip
    if plan.tf32:
        scratch += [operand((DEPTH, plan.head_dim, plan.block_k)), barrier()]
    scratch += staging_scratch(plan, plan.block_q, plan.block_k) + rmw + pair_scratch(plan)
    return scratch + live_scratch(plan, plan.block_k)


def backward(plan: Plan, residuals, cotangents):
    """(dq, dk, dv, dbiases, None per extra) of padded inputs (base.kernel_attention)."""
    _, plgpu = modules()
    plan = plan.with_one_consumer()  # the forward's consumers leave its out/lse layout as is
    q, k, v, biases, extras, out, lse = residuals
    d_out, d_lse = cotangents
    batch, heads, cdt = q.shape[1 if plan.columns else 0], plan.heads, jnp.dtype(plan.compute_dtype)
    delta = softmax_delta(out, d_out, d_lse, plan.columns)  # [B, N, T]
    d_out = d_out.astype(cdt)
    mask = extras[0] if plan.mask_shape is not None else None
    after_mask = extras[1:] if mask is not None else extras  # live vectors, then meta
    flip = lambda x: jnp.swapaxes(x, 2, 3) if x.shape[2] > 1 and x.shape[3] > 1 else x  # noqa: E731
    pair_t = (*(flip(x) for x in biases), *(() if mask is None else (flip(mask),)))
    perm = (1, 2, 3, 0) if plan.columns else (0, 2, 3, 1)  # -> [B, N, D, L]
    tr = lambda *xs: tuple(jnp.transpose(x, perm) for x in xs) if plan.tf32 else ()  # noqa: E731
    one = base.slot_shape(q) if plan.packed else None  # dq, dk, dv: stacked at the end
    k_shape, v_shape, q_shape = (one.shape,) * 3 if plan.packed else (k.shape, v.shape, q.shape)
    dk, dv = plan.launch(
        _dkdv_kernel,
        (batch, plan.kv_heads, plan.k_blocks),
        ("b", "n", "j"),
        (jax.ShapeDtypeStruct(k_shape, cdt), jax.ShapeDtypeStruct(v_shape, cdt)),
        dkdv_scratch(plan),
        (q, k, v, d_out, lse, delta, *tr(q, d_out), *pair_t, *after_mask),
        "gated_attention_mosaic_dkdv",
    )

    if plan.live:  # keys no query head of the group sees: no gradient (NaN garbage in v there)
        live_k = after_mask[1] != 0  # [B|1, N|1, S]
        if live_k.shape[1] > 1:  # per query head: seen by some head of the group
            live_k = jnp.any(
                live_k.reshape(live_k.shape[0], -1, plan.q_heads_per_kv_head, live_k.shape[2]), 2
            )
        seen = jnp.swapaxes(live_k, 1, 2)[..., None]  # [B|1, S, K|1, 1]
        seen = jnp.swapaxes(seen, 0, 1) if plan.columns else seen  # [S, B|1, K|1, 1]
        dk, dv = (jnp.where(seen, x, jnp.zeros((), x.dtype)) for x in (dk, dv))
    shapes = [dbias_shape(plan, shape, batch) for shape in plan.bias_shapes]
    dq, *partials = plan.launch(
        functools.partial(_dq_dbias_kernel, batch=batch),
        (plan.row_groups, heads, plan.q_blocks),
        ("g", "n", "i"),
        (
            jax.ShapeDtypeStruct(q_shape, cdt),
            *(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes),
        ),
        dq_scratch(plan),
        (q, k, v, d_out, lse, delta, *tr(k), *biases, *extras),
        "gated_attention_mosaic_dq_dbias",
    )
    if plan.packed:  # one gradient for the packed array: the kernels write three, stacked
        rest = [jnp.zeros_like(dq)] * (q.shape[2] - 3)  # the caller's slots (api): zero
        dq, dk, dv = jnp.stack((dq, dk, dv, *rest), axis=2), None, None
    return dq, dk, dv, sum_bias_partials(biases, partials), tuple(None for _ in extras)
