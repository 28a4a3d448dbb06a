"""The Mosaic GPU kernels (mosaic.py's docstring: grids, numerics): the forward, the dk/dv kernel
and the dq/bias-gradient kernel, on one pipeline (`_pipeline`: a producer warpgroup streams tiles
by TMA into DEPTH shared-memory slots, the consumer warpgroup waits for each slot, computes with
wgmma and releases it), and the logits they share (`_Tile`).

Every kernel's inputs are padded (mosaic.py): sequence lengths to whole tiles, head dims for
wgmma; keys past the real length are -inf in every tile, rows past it are sliced off.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from gated_attention import masking, numerics
from gated_attention.mosaic_plan import DEPTH, Plan, broadcast_form, modules


class _Stream(NamedTuple):
    """One input streamed through the pipeline: source(r, j) is the global-memory slice of step
    (r, j), copied into buffers.at[slot]; barriers.at[slot] says it arrived."""

    source: Callable
    buffers: Any
    barriers: Any


def _pipeline(plan, rows: int, span, streams, consumed, begin, step, end, carry_rows=False):
    """For r < rows and j in span(r) = [lo, hi): the producer (wg 1) copies every stream's slice
    of (r, j) into slot count % DEPTH, first waiting until the consumer released the slot's
    previous use; the consumer (wg 0) runs carry = begin(r), carry = step(r, j, slot, carry) once
    the slot's copies arrived, then end(r, carry). carry_rows: one carry over all rows,
    begin(None) before the first and end(None, carry) after the last."""
    pl, plgpu = modules()
    wg = lax.axis_index("wg")
    alone = plan.warpgroups == 1  # the consumer issues its own copies (INTERPRET_WARPGROUPS)

    def issue(r, j, slot):
        for s in streams:
            plgpu.copy_gmem_to_smem(s.source(r, j), s.buffers.at[slot], s.barriers.at[slot])

    def produce():
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
        pl.when(wg == 1)(produce)

    @pl.when(wg == 0)
    def _consume():
        def steps(r, count, carry):
            def compute(j, state):
                count, carry = state
                slot = lax.rem(count, jnp.int32(DEPTH))
                if alone:
                    issue(r, j, slot)
                for s in streams:
                    plgpu.barrier_wait(s.barriers.at[slot])
                carry = step(r, j, slot, carry)
                if not alone:
                    plgpu.barrier_arrive(consumed.at[slot])
                return count + 1, carry

            return lax.fori_loop(*span(r), compute, (count, carry))

        if carry_rows:
            _, carry = lax.fori_loop(
                0, rows, lambda r, state: steps(r, *state), (jnp.int32(0), begin(None))
            )
            end(None, carry)
            return

        def row(r, count):
            count, carry = steps(r, count, begin(r))
            end(r, carry)
            return count

        lax.fori_loop(0, rows, row, jnp.int32(0))


def _zero_dead_rows(plan: Plan, ref, live_ref):
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


def _vector_source(plan: Plan, ref, b_of, head_of, block_of, size: int):
    """source(r, j) of an int32 live vector [B|1, N|1, L] in blocks of `size`."""
    pl, _ = modules()

    def source(r, j):
        bb = b_of(r) if ref.shape[0] > 1 else 0
        nn = head_of(r) if ref.shape[1] > 1 else 0
        return ref.at[bb, nn, pl.ds(block_of(r, j) * size, size)]

    return source


def _live_scratch(plan: Plan, size: int) -> list:
    """DEPTH slots of a live vector and their barriers (when the plan has them)."""
    if not plan.live:
        return []
    _, plgpu = modules()
    return [plan.smem((DEPTH, size), jnp.int32), plgpu.Barrier(num_barriers=DEPTH)]


def _operand(plan: Plan, x, staging):
    """Registers x as a wgmma left operand: as they are in 16-bit types; through the shared-memory
    `staging` tile for float32 (TF32 wgmma reads A from shared memory only)."""
    x = x.astype(plan.compute_dtype)
    if staging is None:
        return x
    _, plgpu = modules()
    staging[...] = x
    plgpu.commit_smem()  # order the stores before the tensor cores' reads
    return staging


def _staging(plan: Plan, rows: int, cols: int):
    """The scratch _operand needs: a float32 tile, or none."""
    if jnp.dtype(plan.compute_dtype) != jnp.float32:
        return []
    return [plan.smem((rows, cols), jnp.float32, operand=True)]


def _gather(ref, form: str, b, n, i, j, plan: Plan, transposed: bool = False):
    """The global slice of a [B|1, N|1, T|1, S|1] array (transposed: [B|1, N|1, S, T], tiles
    only) for query block i, key block j."""
    pl, _ = modules()
    bb = b if ref.shape[0] > 1 else 0
    nn = n if ref.shape[1] > 1 else 0
    qs, ks = pl.ds(i * plan.block_q, plan.block_q), pl.ds(j * plan.block_k, plan.block_k)
    if form == "tile":
        return ref.at[bb, nn, ks, qs] if transposed else ref.at[bb, nn, qs, ks]
    return ref.at[bb, nn, 0, ks] if form == "keys" else ref.at[bb, nn, qs, 0]


def _tile_buffer(plan: Plan, shape, dtype, transposed: bool = False):
    """DEPTH slots for one bias or mask's tiles."""
    tile = {
        "tile": (plan.block_k, plan.block_q) if transposed else (plan.block_q, plan.block_k),
        "keys": (plan.block_k,),
        "queries": (plan.block_q,),
    }[broadcast_form(shape)]
    return plan.smem((DEPTH, *tile), dtype)


def _widen(plan: Plan, ref, shape, transposed: bool = False):
    """A bias or mask slot to registers: [bq, bk] ([bk, bq] transposed, from a transposed tile)."""
    ops = plan.ops
    form = broadcast_form(shape)
    if form == "tile":
        return ops.load(ref)
    tile = (plan.block_k, plan.block_q) if transposed else (plan.block_q, plan.block_k)
    q_axis = 1 if transposed else 0
    along = 1 - q_axis if form == "keys" else q_axis
    return lax.broadcast_in_dim(ops.load(ref, axis=1 - along), tile, (along,))


class _Meta(NamedTuple):
    offset: Any
    q_length: Any
    kv_length: Any


def _meta(meta_ref, b):
    """Batch row b's structure scalars (masking.Structure.meta), or None."""
    if meta_ref is None:
        return None
    return _Meta(meta_ref[b, 0], meta_ref[b, 1], meta_ref[b, 2])


def key_blocks(plan: Plan, st, i):
    """[lo, hi): the key blocks some query of query block i may attend."""
    if st is None:
        return jnp.int32(0), jnp.int32(plan.k_blocks)
    first = st.offset + i * plan.block_q
    lo, hi = masking.key_span(
        first, first + plan.block_q - 1, plan.causal, plan.window, plan.k_len, st.q_length,
        st.kv_length,
    )  # fmt: skip
    return masking.tiles(lo, hi, plan.block_k)


def query_blocks(plan: Plan, st, j):
    """[lo, hi): the query blocks with a query that may attend some key of key block j."""
    if st is None:
        return jnp.int32(0), jnp.int32(plan.q_blocks)
    k_first = j * plan.block_k
    lo, hi = masking.query_span(
        k_first, k_first + plan.block_k - 1, plan.causal, plan.window, st.offset, plan.q_len,
        st.q_length, st.kv_length,
    )  # fmt: skip
    return masking.tiles(lo - st.offset, hi - st.offset, plan.block_q)


def _logits(plan: Plan, s, bias_tiles, mask_tile, st, i, j, transposed: bool = False):
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
        s = jnp.where(mask_tile != 0, s, numerics.MASK_VALUE)
    tile = s.shape
    q_axis, k_axis = (1, 0) if transposed else (0, 1)
    kj = None
    if st is not None or plan.k_pad != plan.k_len:
        kj = j * plan.block_k + ops.iota(tile, k_axis)
    if st is not None:
        qi = st.offset + i * plan.block_q + ops.iota(tile, q_axis)
        ok = masking.allowed(qi, kj, plan.causal, plan.window, st.q_length, st.kv_length)
        s = jnp.where(ok, s, numerics.MASK_VALUE)
    if plan.k_pad != plan.k_len:
        s = jnp.where(kj < plan.k_len, s, -jnp.inf)
    return s, cap_grad


def _pair_streams(
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
            return _gather(ref, form, b_of(r), n_of(r), i_of(r, j), j_of(r, j), plan, transposed)

        streams.append(_Stream(source, buf, bar))
        bias_slots.append(buf)
    mask_slots = bias_slots.pop() if mask_ref is not None else None
    return streams, bias_slots, mask_slots


def _pair_scratch(plan: Plan, transposed: bool = False):
    """Scratch for _pair_streams: (buffer, barriers) per bias, then the mask's."""
    _, plgpu = modules()
    out = []
    pairs = list(zip(plan.bias_shapes, plan.bias_dtypes, strict=True))
    if plan.mask_shape is not None:
        pairs.append((plan.mask_shape, plan.mask_dtype))
    for shape, dtype in pairs:
        out += [_tile_buffer(plan, shape, dtype, transposed), plgpu.Barrier(num_barriers=DEPTH)]
    return out


def _forward_kernel(*refs, plan: Plan):
    pl, plgpu = modules()
    ops = plan.ops
    front, bias_refs, mask_ref, (_, live_k_ref), meta_ref, refs = _split_refs(plan, refs, 3)
    q_ref, k_ref, v_ref = front
    o_ref, lse_ref = refs.pop(0), refs.pop(0)
    q_smem, q_bar, k_buf, k_bar, v_buf, v_bar, consumed, o_smem, lse_smem, *scratch = refs
    staging = scratch.pop(0) if jnp.dtype(plan.compute_dtype) == jnp.float32 else None
    b, n, i = lax.axis_index("b"), lax.axis_index("n"), lax.axis_index("i")
    kv = lax.div(n, jnp.int32(plan.group))
    st = _meta(meta_ref, b)
    lo, hi = key_blocks(plan, st, i)

    def k_source(r, j):
        return k_ref.at[b, pl.ds(j * plan.block_k, plan.block_k), kv]

    def v_source(r, j):
        if plan.tf32:  # v transposed: [B, K, Dv, S]
            return v_ref.at[b, kv, :, pl.ds(j * plan.block_k, plan.block_k)]
        return v_ref.at[b, pl.ds(j * plan.block_k, plan.block_k), kv]

    pair, bias_slots, mask_slots = _pair_streams(
        plan, bias_refs, mask_ref, scratch, lambda r: b, lambda r: n, lambda r, j: i,
        lambda r, j: j,
    )  # fmt: skip
    streams = [_Stream(k_source, k_buf, k_bar), _Stream(v_source, v_buf, v_bar), *pair]
    if plan.live:  # keys no query of head n sees: zeroed in v before p @ v
        live_buf, live_bar = scratch[-2:]
        source = _vector_source(plan, live_k_ref, lambda r: b, lambda r: n, lambda r, j: j,
                                plan.block_k)  # fmt: skip
        streams.append(_Stream(source, live_buf, live_bar))

    def begin(r):
        plgpu.copy_gmem_to_smem(
            q_ref.at[b, pl.ds(i * plan.block_q, plan.block_q), n], q_smem, q_bar.at[0]
        )
        plgpu.barrier_wait(q_bar.at[0])
        acc = ops.zeros((plan.block_q, plan.value_dim))
        return acc, ops.zeros((plan.block_q,), 1, -jnp.inf), ops.zeros((plan.block_q,), 1)

    def step(r, j, slot, carry):
        acc, m_prev, l_prev = carry
        s = ops.dot(q_smem, k_buf.at[slot], trans_b=True)
        biases = [_widen(plan, buf.at[slot], shape) for buf, shape in zip(bias_slots, plan.bias_shapes)]
        mask = None if mask_slots is None else _widen(plan, mask_slots.at[slot], plan.mask_shape)
        s, _ = _logits(plan, s, biases, mask, st, i, j)
        m = jnp.maximum(m_prev, jnp.max(s, axis=1))
        correction = jnp.exp(m_prev - m)
        p = jnp.exp(s - lax.broadcast_in_dim(m, s.shape, (0,)))
        acc = acc * lax.broadcast_in_dim(correction, acc.shape, (0,))
        if plan.live:
            _zero_dead_rows(plan, v_buf.at[slot], live_buf.at[slot])
        acc = ops.dot(_operand(plan, p, staging), v_buf.at[slot], trans_b=plan.tf32, acc=acc)
        return acc, m, l_prev * correction + jnp.sum(p, axis=1)

    def end(r, carry):
        acc, m, total = carry
        if st is not None:  # a row whose every key block was skipped: 0 and a finite lse
            seen = total > 0
            total = jnp.where(seen, total, 1.0)
            m = jnp.where(seen, m, numerics.MASK_VALUE)
        o_smem[...] = (acc / lax.broadcast_in_dim(total, acc.shape, (0,))).astype(o_smem.dtype)
        lse_smem[...] = m + jnp.log(total)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, pl.ds(i * plan.block_q, plan.block_q), n])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, n, pl.ds(i * plan.block_q, plan.block_q)])
        plgpu.wait_smem_to_gmem(0)

    _pipeline(plan, 1, lambda r: (lo, hi), streams, consumed, begin, step, end)


def forward_scratch(plan: Plan) -> list:
    """The forward kernel's shared memory and barriers, in the order it unpacks them."""
    _, plgpu = modules()
    cdt = jnp.dtype(plan.compute_dtype)
    return [
        plan.smem((plan.block_q, plan.head_dim), cdt, operand=True),
        plgpu.Barrier(num_barriers=1),
        plan.smem((DEPTH, plan.block_k, plan.head_dim), cdt, operand=True),
        plgpu.Barrier(num_barriers=DEPTH),
        plan.smem(_kv_tile(plan, plan.value_dim), cdt, operand=True),
        plgpu.Barrier(num_barriers=DEPTH),
        plgpu.Barrier(num_barriers=DEPTH),  # consumed
        plan.smem((plan.block_q, plan.value_dim), cdt, operand=True),
        plan.smem((plan.block_q,), jnp.float32),
        *_staging(plan, plan.block_q, plan.block_k),
        *_pair_scratch(plan),
        *_live_scratch(plan, plan.block_k),
    ]


def shared_memory_bytes(plan: Plan) -> int:
    """The most shared memory one of the three kernels' blocks takes (barriers aside)."""

    def total(scratch):
        return sum(
            math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
            for x in scratch
            if hasattr(x, "dtype") and hasattr(x, "shape")
        )

    return max(total(f(plan)) for f in (forward_scratch, dkdv_scratch, dq_scratch))


def forward(plan: Plan, q, k, v, biases, extras):
    """(out [B, Tp, N, Dv] in the compute dtype, lse [B, N, Tp] float32) of padded inputs."""
    batch, heads, cdt = q.shape[0], plan.heads, jnp.dtype(plan.compute_dtype)
    v_op = jnp.transpose(v, (0, 2, 3, 1)) if plan.tf32 else v
    out_type = (
        jax.ShapeDtypeStruct((batch, plan.q_pad, heads, plan.value_dim), cdt),
        jax.ShapeDtypeStruct((batch, heads, plan.q_pad), jnp.float32),
    )
    return plan.launch(
        _forward_kernel,
        (batch, heads, plan.q_blocks),
        ("b", "n", "i"),
        out_type,
        forward_scratch(plan),
        (q, k, v_op, *biases, *extras),
        "gated_attention_mosaic_forward",
    )


def _kv_tile(plan: Plan, width: int):
    """DEPTH slots of a key-side operand read as a wgmma right operand [bk, width] (TF32: its
    transpose [width, bk])."""
    return (DEPTH, width, plan.block_k) if plan.tf32 else (DEPTH, plan.block_k, width)


def _split_refs(plan: Plan, refs, n_front: int):
    """refs -> (front refs, bias refs, mask ref, (live_q, live_k) refs, meta ref, rest)."""
    refs = list(refs)
    front = [refs.pop(0) for _ in range(n_front)]
    biases = [refs.pop(0) for _ in range(len(plan.bias_shapes))]
    mask = refs.pop(0) if plan.mask_shape is not None else None
    live = (refs.pop(0), refs.pop(0)) if plan.live else (None, None)
    meta = refs.pop(0) if plan.structured else None
    return front, biases, mask, live, meta, refs


def _dkdv_kernel(*refs, plan: Plan):
    """dk, dv of key block j of key/value head kv, summed over the group's query heads, in the
    transposed orientation (s.T = k @ q.T [bk, bq]) so that p.T and ds.T are left operands."""
    pl, plgpu = modules()
    ops = plan.ops
    front, bias_refs, mask_ref, live_refs, meta_ref, rest = _split_refs(
        plan, refs, 8 if plan.tf32 else 6
    )
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *transposed = front
    qt_ref, dot_ref = transposed if plan.tf32 else (None, None)
    dk_ref, dv_ref, *scratch = rest
    k_smem, v_smem, kv_bar, q_buf, q_bar, do_buf, do_bar, lse_buf, lse_bar = scratch[:9]
    delta_buf, delta_bar, consumed, dk_smem, dv_smem = scratch[9:14]
    scratch = scratch[14:]
    qt_buf, qt_bar, dot_buf, dot_bar = (scratch[:4] if plan.tf32 else (None,) * 4)
    scratch = scratch[4:] if plan.tf32 else scratch
    staging = scratch.pop(0) if plan.tf32 else None
    b, kv, j = lax.axis_index("b"), lax.axis_index("n"), lax.axis_index("j")
    st = _meta(meta_ref, b)
    lo, hi = query_blocks(plan, st, j)
    head = lambda r: kv * plan.group + r  # noqa: E731
    ks = pl.ds(j * plan.block_k, plan.block_k)
    qs = lambda i: pl.ds(i * plan.block_q, plan.block_q)  # noqa: E731
    streams = [
        _Stream(lambda r, i: q_ref.at[b, qs(i), head(r)], q_buf, q_bar),
        _Stream(lambda r, i: do_ref.at[b, qs(i), head(r)], do_buf, do_bar),
        _Stream(lambda r, i: lse_ref.at[b, head(r), qs(i)], lse_buf, lse_bar),
        _Stream(lambda r, i: delta_ref.at[b, head(r), qs(i)], delta_buf, delta_bar),
    ]
    if plan.tf32:
        streams += [
            _Stream(lambda r, i: qt_ref.at[b, head(r), :, qs(i)], qt_buf, qt_bar),
            _Stream(lambda r, i: dot_ref.at[b, head(r), :, qs(i)], dot_buf, dot_bar),
        ]
    pair, bias_slots, mask_slots = _pair_streams(
        plan, bias_refs, mask_ref, scratch, lambda r: b, head, lambda r, i: i, lambda r, i: j,
        transposed=True,
    )  # fmt: skip
    streams += pair
    if plan.live:  # queries of head(r) with no key: zeroed in q before ds.T @ q
        live_buf, live_bar = scratch[-2:]
        source = _vector_source(plan, live_refs[0], lambda r: b, head, lambda r, i: i,
                                plan.block_q)  # fmt: skip
        streams.append(_Stream(source, live_buf, live_bar))

    @pl.when(lax.axis_index("wg") == 0)
    def _():
        plgpu.copy_gmem_to_smem(k_ref.at[b, ks, kv], k_smem, kv_bar.at[0])
        plgpu.copy_gmem_to_smem(v_ref.at[b, ks, kv], v_smem, kv_bar.at[1])
        plgpu.barrier_wait(kv_bar.at[0])
        plgpu.barrier_wait(kv_bar.at[1])

    def begin(r):
        return ops.zeros((plan.block_k, plan.head_dim)), ops.zeros((plan.block_k, plan.value_dim))

    def step(r, i, slot, carry):
        dk, dv = carry
        st_ = ops.dot(k_smem, q_buf.at[slot], trans_b=True)  # [bk, bq]
        biases = [
            _widen(plan, buf.at[slot], shape, transposed=True)
            for buf, shape in zip(bias_slots, plan.bias_shapes, strict=True)
        ]
        mask = None
        if mask_slots is not None:
            mask = _widen(plan, mask_slots.at[slot], plan.mask_shape, transposed=True)
        s, cap_grad = _logits(plan, st_, biases, mask, st, i, j, transposed=True)
        lse = ops.load(lse_buf.at[slot], axis=0)
        p = jnp.exp(s - lax.broadcast_in_dim(lse, s.shape, (1,)))
        dp = ops.dot(v_smem, do_buf.at[slot], trans_b=True)  # [bk, bq]
        delta = ops.load(delta_buf.at[slot], axis=0)
        ds = p * (dp - lax.broadcast_in_dim(delta, s.shape, (1,)))
        if cap_grad is not None:
            ds = ds * cap_grad
        if plan.live:
            _zero_dead_rows(plan, q_buf.at[slot], live_buf.at[slot])
        if plan.tf32:
            dv = ops.dot(_operand(plan, p, staging), dot_buf.at[slot], trans_b=True, acc=dv)
            dk = ops.dot(_operand(plan, ds, staging), qt_buf.at[slot], trans_b=True, acc=dk)
        else:
            dv = ops.dot(_operand(plan, p, None), do_buf.at[slot], acc=dv)
            dk = ops.dot(_operand(plan, ds, None), q_buf.at[slot], acc=dk)
        return dk, dv

    def end(r, carry):  # after the group's last head: the accumulators span the group
        dk, dv = carry
        dk_smem[...] = (dk * plan.scale).astype(dk_smem.dtype)
        dv_smem[...] = dv.astype(dv_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(dk_smem, dk_ref.at[b, ks, kv])
        plgpu.copy_smem_to_gmem(dv_smem, dv_ref.at[b, ks, kv])
        plgpu.wait_smem_to_gmem(0)

    _pipeline(plan, plan.group, lambda r: (lo, hi), streams, consumed, begin, step, end,
              carry_rows=True)  # fmt: skip


def dbias_shape(plan: Plan, shape, batch: int):
    """The float32 buffer of one bias's gradient: [B or groups, N, Tp (or query blocks for a
    bias without T), Sp or 1]; XLA sums it to the bias's shape afterwards."""
    slots = batch if shape[0] > 1 else plan.groups
    return (
        slots,
        plan.heads,
        plan.q_pad if shape[2] > 1 else plan.q_blocks,
        plan.k_pad if shape[3] > 1 else 1,
    )


def _dq_dbias_kernel(*refs, plan: Plan, batch: int):
    """dq of query block i of head n for each batch row g, g + groups, ...; and the bias
    gradients of those rows (summed per group for a bias shared over the batch) by
    read-modify-write of this program's own tiles, so no two programs touch one tile."""
    pl, plgpu = modules()
    ops = plan.ops
    front, bias_refs, mask_ref, live_refs, meta_ref, rest = _split_refs(
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
    kv = lax.div(n, jnp.int32(plan.group))
    b_of = lambda r: g + plan.groups * r  # noqa: E731
    qs = pl.ds(i * plan.block_q, plan.block_q)
    ks = lambda j: pl.ds(j * plan.block_k, plan.block_k)  # noqa: E731
    streams = [
        _Stream(lambda r, j: k_ref.at[b_of(r), ks(j), kv], k_buf, k_bar),
        _Stream(lambda r, j: v_ref.at[b_of(r), ks(j), kv], v_buf, v_bar),
    ]
    if plan.tf32:
        streams.append(_Stream(lambda r, j: kt_ref.at[b_of(r), kv, :, ks(j)], kt_buf, kt_bar))
    pair, bias_slots, mask_slots = _pair_streams(
        plan, bias_refs, mask_ref, scratch, b_of, lambda r: n, lambda r, j: i, lambda r, j: j
    )
    streams += pair
    if plan.live:  # keys no query of head n sees: zeroed in k and v before ds @ k, do @ v.T
        live_buf, live_bar = scratch[-2:]
        source = _vector_source(plan, live_refs[1], b_of, lambda r: n, lambda r, j: j,
                                plan.block_k)  # fmt: skip
        streams.append(_Stream(source, live_buf, live_bar))

    def dbias_view(t, b, j):
        shape, ref = plan.bias_shapes[t], dbias_refs[t]
        slot = b if shape[0] > 1 else g
        form = broadcast_form(shape)
        if form == "tile":
            return ref.at[slot, n, qs, ks(j)]
        return ref.at[slot, n, i, ks(j)] if form == "keys" else ref.at[slot, n, qs, 0]

    def zero_fill(r, b):
        """Zeroes this program's tiles of each bias gradient, before the first add to them."""
        for t, (smem, _) in enumerate(rmw):
            shared = plan.bias_shapes[t][0] == 1

            @pl.when(jnp.logical_or(not shared, r == 0))
            def _(t=t, smem=smem):
                form = broadcast_form(plan.bias_shapes[t])
                smem[...] = ops.zeros(smem.shape, {"tile": None, "keys": 0, "queries": 1}[form])
                plgpu.commit_smem()
                blocks = 1 if broadcast_form(plan.bias_shapes[t]) == "queries" else plan.k_blocks

                @pl.loop(0, blocks)
                def _(j):
                    plgpu.copy_smem_to_gmem(smem, dbias_view(t, b, j))

                plgpu.wait_smem_to_gmem(0)

    def accumulate(t, b, j, ds):
        smem, bar = rmw[t]
        form = broadcast_form(plan.bias_shapes[t])
        view = dbias_view(t, b, j)
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

    def begin(r):
        b = b_of(r)
        for src, dst, k in (
            (q_ref.at[b, qs, n], q_smem, 0),
            (do_ref.at[b, qs, n], do_smem, 1),
            (lse_ref.at[b, n, qs], lse_smem, 2),
            (delta_ref.at[b, n, qs], delta_smem, 3),
        ):
            plgpu.copy_gmem_to_smem(src, dst, row_bar.at[k])
        for k in range(4):
            plgpu.barrier_wait(row_bar.at[k])
        zero_fill(r, b)
        return ops.zeros((plan.block_q, plan.head_dim))

    def step(r, j, slot, dq):
        b = b_of(r)
        st = _meta(meta_ref, b)
        if plan.live:
            _zero_dead_rows(plan, k_buf.at[slot], live_buf.at[slot])
            _zero_dead_rows(plan, v_buf.at[slot], live_buf.at[slot])
        s = ops.dot(q_smem, k_buf.at[slot], trans_b=True)
        biases = [
            _widen(plan, buf.at[slot], shape)
            for buf, shape in zip(bias_slots, plan.bias_shapes, strict=True)
        ]
        mask = None if mask_slots is None else _widen(plan, mask_slots.at[slot], plan.mask_shape)
        s, cap_grad = _logits(plan, s, biases, mask, st, i, j)
        lse = ops.load(lse_smem, axis=1)
        p = jnp.exp(s - lax.broadcast_in_dim(lse, s.shape, (0,)))
        dp = ops.dot(do_smem, v_buf.at[slot], trans_b=True)
        delta = ops.load(delta_smem, axis=1)
        ds = p * (dp - lax.broadcast_in_dim(delta, s.shape, (0,)))
        if cap_grad is not None:
            ds = ds * cap_grad
        for t in range(n_bias):
            accumulate(t, b, j, ds)
        if plan.tf32:
            return ops.dot(_operand(plan, ds, staging), kt_buf.at[slot], trans_b=True, acc=dq)
        return ops.dot(_operand(plan, ds, None), k_buf.at[slot], acc=dq)

    def end(r, dq):
        dq_smem[...] = (dq * plan.scale).astype(dq_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(dq_smem, dq_ref.at[b_of(r), qs, n])
        plgpu.wait_smem_to_gmem(0)

    def span(r):
        return key_blocks(plan, _meta(meta_ref, b_of(r)), i)

    rows = lax.div(batch - g + plan.groups - 1, jnp.int32(plan.groups))
    _pipeline(plan, rows, span, streams, consumed, begin, step, end)


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
    scratch += _staging(plan, plan.block_k, plan.block_q) + _pair_scratch(plan, True)
    return scratch + _live_scratch(plan, plan.block_q)


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
    scratch += _staging(plan, plan.block_q, plan.block_k) + rmw + _pair_scratch(plan)
    return scratch + _live_scratch(plan, plan.block_k)


def backward(plan: Plan, residuals, cotangents):
    """(dq, dk, dv, dbiases, None per extra) of padded inputs (base.kernel_attention)."""
    _, plgpu = modules()
    q, k, v, biases, extras, out, lse = residuals
    d_out, d_lse = cotangents
    batch, heads, cdt = q.shape[0], plan.heads, jnp.dtype(plan.compute_dtype)
    delta = jnp.einsum("btnh,btnh->bnt", out.astype(jnp.float32), d_out.astype(jnp.float32))
    delta = delta - d_lse.astype(jnp.float32)
    d_out = d_out.astype(cdt)
    mask = extras[0] if plan.mask_shape is not None else None
    after_mask = extras[1:] if mask is not None else extras  # live vectors, then meta
    flip = lambda x: jnp.swapaxes(x, 2, 3) if x.shape[2] > 1 and x.shape[3] > 1 else x  # noqa: E731
    pair_t = (*(flip(x) for x in biases), *(() if mask is None else (flip(mask),)))
    tr = lambda *xs: tuple(jnp.transpose(x, (0, 2, 3, 1)) for x in xs) if plan.tf32 else ()  # noqa: E731
    dk, dv = plan.launch(
        _dkdv_kernel,
        (batch, plan.kv_heads, plan.k_blocks),
        ("b", "n", "j"),
        (jax.ShapeDtypeStruct(k.shape, cdt), jax.ShapeDtypeStruct(v.shape, cdt)),
        dkdv_scratch(plan),
        (q, k, v, d_out, lse, delta, *tr(q, d_out), *pair_t, *after_mask),
        "gated_attention_mosaic_dkdv",
    )

    if plan.interpret:  # one interpreted kernel at a time (mosaic_plan.serialize)
        dk, dv, q = lax.optimization_barrier((dk, dv, q))
    shapes = [dbias_shape(plan, shape, batch) for shape in plan.bias_shapes]
    dq, *partials = plan.launch(
        functools.partial(_dq_dbias_kernel, batch=batch),
        (plan.groups, heads, plan.q_blocks),
        ("g", "n", "i"),
        (
            jax.ShapeDtypeStruct(q.shape, cdt),
            *(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes),
        ),
        dq_scratch(plan),
        (q, k, v, d_out, lse, delta, *tr(k), *biases, *extras),
        "gated_attention_mosaic_dq_dbias",
    )
    dbiases = []
    for bias, partial in zip(biases, partials, strict=True):
        axes = tuple(a for a in range(4) if bias.shape[a] == 1 and partial.shape[a] > 1)
        dbiases.append(jnp.sum(partial, axis=axes, keepdims=True).astype(bias.dtype))
    return dq, dk, dv, tuple(dbiases), tuple(None for _ in extras)


