"""The Pallas TPU kernels (attention/pallas_mosaic_tpu/implementation.py's docstring: layout, grids, numerics): the forward, the
three backward kernels (dk/dv, dq, the bias gradients) with the per-step tile helpers they share
(_Tile: loads, per-head slices, logits and weights; any_allowed, the structure's skip test) and
their launches, forward and backward, the pair attention/pallas_mosaic_tpu/implementation.py makes a custom VJP of.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from gated_attention.attention.pallas_mosaic_tpu.plan import Plan
from gated_attention.attention.pallas_mosaic_tpu.plan import pallas_modules as _pallas
from gated_attention.core import masking, numerics

NT = (((1,), (1,)), ((), ()))  # a @ b.T
TN = (((0,), (0,)), ((), ()))  # a.T @ b


def _column(row):
    """[1, L] -> [L, 1] (a masked lane sum: Mosaic has no transpose of every shape)."""
    n = row.shape[1]
    eye = lax.broadcasted_iota(jnp.int32, (n, n), 0) == lax.broadcasted_iota(jnp.int32, (n, n), 1)
    return jnp.sum(jnp.where(eye, jnp.broadcast_to(row, (n, n)), 0.0), axis=1, keepdims=True)


def _row(column):
    """[L, 1] -> [1, L]."""
    n = column.shape[0]
    eye = lax.broadcasted_iota(jnp.int32, (n, n), 0) == lax.broadcasted_iota(jnp.int32, (n, n), 1)
    return jnp.sum(jnp.where(eye, jnp.broadcast_to(column, (n, n)), 0.0), axis=0, keepdims=True)


class _Extras(NamedTuple):
    """The optional refs after the biases (None where absent)."""

    mask: Any  # int8 [N|1, bq|1, bk|1] tile
    live_q: Any  # float32 [N|1, bq|1] tile
    live_k: Any  # float32 [N|1, bk|1] tile
    meta: Any  # int32 [3 * B] in SMEM (masking.StructuredMask.meta, flat)


def any_allowed(plan: Plan, i, j, offset, q_length, kv_length):
    """Whether the causal, window and length masks let any query of tile (i, j) attend any of its
    keys (a scalar; ints or traced): tiles they mask whole are skipped."""
    first = offset + i * plan.block_q
    lo, hi = masking.key_span(
        first, first + plan.block_q - 1, plan.causal, plan.window, plan.k_len, q_length, kv_length
    )
    k_first = j * plan.block_k
    return (hi > lo) & (k_first < hi) & (k_first + plan.block_k > lo)


class _Tile:
    """One grid step's tiles: loads of rows and per-head slices, logits and weights."""

    def __init__(self, plan: Plan, i, j, b, bias_refs, extras: _Extras):
        self.plan, self.i, self.j = plan, i, j
        self.bias_refs, self.extras = bias_refs, extras
        bq, bk = plan.block_q, plan.block_k
        # Rows of the tile inside the sequences (partial last blocks read past the end).
        self.q_ok = lax.broadcasted_iota(jnp.int32, (bq, 1), 0) < plan.q_len - i * bq
        self.k_ok = lax.broadcasted_iota(jnp.int32, (bk, 1), 0) < plan.k_len - j * bk
        self.k_ok_row = lax.broadcasted_iota(jnp.int32, (1, bk), 1) < plan.k_len - j * bk
        self.allowed = self.any_allowed = None
        if plan.structured:
            meta = extras.meta
            offset, q_length, kv_length = meta[3 * b], meta[3 * b + 1], meta[3 * b + 2]
            self.allowed = self._allowed(offset, q_length, kv_length)
            self.any_allowed = any_allowed(plan, i, j, offset, q_length, kv_length)

    def _allowed(self, offset, q_length, kv_length):
        """bool [bq, bk]: the causal, window and length masks of this tile (masking.allowed)."""
        plan = self.plan
        shape = (plan.block_q, plan.block_k)
        qi = offset + self.i * plan.block_q + lax.broadcasted_iota(jnp.int32, shape, 0)
        kj = self.j * plan.block_k + lax.broadcasted_iota(jnp.int32, shape, 1)
        return masking.allowed(qi, kj, plan.causal, plan.window, q_length, kv_length)

    def when_allowed(self, body):
        """Runs body() unless the structure masks this tile whole."""
        if self.any_allowed is None:
            body()
        else:
            pl, _ = _pallas()
            pl.when(self.any_allowed)(body)

    def rows(self, ref, ok):
        """A [block, width] tile in the compute dtype, rows past the end zeroed."""
        x = ref[...].astype(self.plan.compute_dtype)
        return jnp.where(ok, x, jnp.zeros((), x.dtype))

    def head(self, x, n: int, width: int, live=None):
        """Head n's [block, width] slice of a [block, N * width] tile, dead rows zeroed."""
        x = x[:, n * width : (n + 1) * width]
        if live is not None:
            x = jnp.where(live != 0, x, jnp.zeros((), x.dtype))
        return x

    def live(self, ref, n: int):
        """Head n's liveness column [block, 1] of a [N|1, block] vector tile (None: no mask)."""
        if ref is None:
            return None
        return _column(ref[n if ref.shape[0] > 1 else 0][None, :])

    def logits(self, q, k, n: int):
        """Head n's scaled, biased, soft-capped, masked float32 logits [bq, bk] (keys past the end
        -inf), and the soft cap's derivative there (None: no cap)."""
        plan = self.plan
        s = lax.dot_general(q, k, NT, precision=plan.precision, preferred_element_type=jnp.float32)
        s = s * plan.scale
        for ref in self.bias_refs:
            s = s + ref[n if ref.shape[0] > 1 else 0].astype(jnp.float32)
        cap_grad = None
        if plan.soft_cap is not None:
            t = jnp.tanh(s * (1.0 / plan.soft_cap))
            # Outside the arrays (a partial tile's bias may read garbage) the derivative is 0.
            s, cap_grad = plan.soft_cap * t, jnp.where(self.q_ok & self.k_ok_row, 1.0 - t * t, 0.0)
        mask = self.extras.mask
        if mask is not None:
            keep = mask[n if mask.shape[0] > 1 else 0].astype(jnp.int32)
            s = jnp.where(keep != 0, s, numerics.MASK_VALUE)
        if self.allowed is not None:
            s = jnp.where(self.allowed, s, numerics.MASK_VALUE)
        return jnp.where(self.k_ok_row, s, -jnp.inf), cap_grad

    def weights(self, s, lse_row):
        """Softmax weights [bq, bk] from saved log-sum-exps [1, bq]; zero past the last query."""
        lse = _column(jnp.where(self.q_ok_row(), lse_row, 0.0))
        return jnp.where(self.q_ok, jnp.exp(s - lse), 0.0)

    def q_ok_row(self):
        bq = self.plan.block_q
        return lax.broadcasted_iota(jnp.int32, (1, bq), 1) < self.plan.q_len - self.i * bq


def _split(plan: Plan, refs):
    """refs after the fixed ones -> (bias refs, _Extras, the rest)."""
    n = len(plan.bias_shapes)
    biases, rest = refs[:n], list(refs[n:])
    take = lambda present: rest.pop(0) if present else None
    mask = take(plan.mask_shape is not None)
    live_q, live_k = take(plan.live_shapes is not None), take(plan.live_shapes is not None)
    meta = take(plan.structured)
    return biases, _Extras(mask, live_q, live_k, meta), tuple(rest)


def _dot(a, b, dims, plan):
    return lax.dot_general(a, b, dims, precision=plan.precision, preferred_element_type=jnp.float32)


def _heads(plan: Plan, tile: _Tile, q_ref, k_ref, v_ref):
    """Per query head n of this step: (n, q, k, v) slices (k and v of key/value head
    n // group), rows past the end and dead queries and keys zeroed (a generator: one head's
    tiles live at a time)."""
    q = tile.rows(q_ref, tile.q_ok)
    k, v = tile.rows(k_ref, tile.k_ok), tile.rows(v_ref, tile.k_ok)
    h, hv = plan.head_dim, plan.value_dim
    for n in range(plan.heads):
        live_k = tile.live(tile.extras.live_k, n)
        qn = tile.head(q, n, h, tile.live(tile.extras.live_q, n))
        kv = n // plan.q_heads_per_kv_head
        yield n, qn, tile.head(k, kv, h, live_k), tile.head(v, kv, hv, live_k)


def _forward_kernel(q_ref, k_ref, v_ref, *refs, plan: Plan):
    pl, _ = _pallas()
    bias_refs, extras, (o_ref, lse_ref, m_scr, l_scr, acc_scr) = _split(plan, refs)
    b, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    tile = _Tile(plan, i, j, b, bias_refs, extras)

    @pl.when(j == 0)
    def _():
        m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    def step():
        for n, qn, kn, vn in _heads(plan, tile, q_ref, k_ref, v_ref):
            s, _ = tile.logits(qn, kn, n)
            m_prev = m_scr[n]
            m = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            correction = jnp.exp(m_prev - m)
            p = jnp.exp(s - m)
            l_scr[n] = l_scr[n] * correction + jnp.sum(p, axis=1, keepdims=True)
            acc_scr[n] = acc_scr[n] * correction + _dot(p.astype(vn.dtype), vn, _NN, plan)
            m_scr[n] = m

    tile.when_allowed(step)

    @pl.when(j == pl.num_programs(2) - 1)
    def _():
        outs = []
        for n in range(plan.heads):
            # A row whose every tile was skipped has total 0: output 0 (the caller gives it the
            # uniform average) and a finite log-sum-exp for the backward.
            total = l_scr[n]
            seen = total > 0
            outs.append(acc_scr[n] / jnp.where(seen, total, 1.0))
            lse = jnp.where(
                seen, m_scr[n] + jnp.log(jnp.where(seen, total, 1.0)), numerics.MASK_VALUE
            )
            lse_ref[n : n + 1, :] = _row(lse)
        out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
        o_ref[...] = out.astype(o_ref.dtype)


_NN = (((1,), (0,)), ((), ()))  # a @ b


def forward(plan: Plan, q, k, v, biases, extras):
    order = "bij"
    n, bq = plan.heads, plan.block_q
    specs = plan.common_specs(order, with_grads=False)
    pl, pltpu = _pallas()
    out_specs = [
        plan.rows_spec(order, "i", n * plan.value_dim),
        plan.vector_spec(order, (plan.batch, n, plan.q_len), "i"),
    ]
    out_shape = (
        jax.ShapeDtypeStruct((plan.batch, plan.q_len, n * plan.value_dim), q.dtype),
        jax.ShapeDtypeStruct((plan.batch, n, plan.q_len), jnp.float32),
    )
    scratch = [
        pltpu.VMEM((n, bq, 1), jnp.float32),
        pltpu.VMEM((n, bq, 1), jnp.float32),
        pltpu.VMEM((n, bq, plan.value_dim), jnp.float32),
    ]
    return plan.call(
        functools.partial(_forward_kernel, plan=plan),
        (plan.batch, plan.q_blocks, plan.k_blocks),
        specs,
        out_specs,
        out_shape,
        scratch,
        ("parallel", "parallel", "arbitrary"),
        (q, k, v, *biases, *extras),
        "gated_attention_tpu_forward",
    )


def _grad_step(plan, tile, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref):
    """Per query head n: (n, qn, kn, do_n, p, ds) of this step, ds the gradient of the logits
    before the soft cap (a generator, one head at a time)."""
    do = tile.rows(do_ref, tile.q_ok)
    for n, qn, kn, vn in _heads(plan, tile, q_ref, k_ref, v_ref):
        do_n = tile.head(do, n, plan.value_dim)
        s, cap_grad = tile.logits(qn, kn, n)
        p = tile.weights(s, lse_ref[n : n + 1, :])
        dp = _dot(do_n, vn, NT, plan)
        delta = _column(jnp.where(tile.q_ok_row(), delta_ref[n : n + 1, :], 0.0))
        ds = p * (dp - delta)
        yield n, qn, kn, do_n, p, ds if cap_grad is None else ds * cap_grad


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, plan: Plan):
    pl, _ = _pallas()
    bias_refs, extras, (dk_ref, dv_ref, dk_scr, dv_scr) = _split(plan, refs)
    b, j, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    tile = _Tile(plan, i, j, b, bias_refs, extras)

    @pl.when(i == 0)
    def _():
        dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
        dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

    def step():
        steps = _grad_step(plan, tile, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref)
        for n, qn, _, do_n, p, ds in steps:  # query heads sum into their key/value head
            dv_scr[n // plan.q_heads_per_kv_head] += _dot(p.astype(do_n.dtype), do_n, TN, plan)
            dk_scr[n // plan.q_heads_per_kv_head] += _dot(ds.astype(qn.dtype), qn, TN, plan)

    tile.when_allowed(step)

    @pl.when(i == pl.num_programs(2) - 1)
    def _():
        dks, dvs = [], []
        for kv in range(plan.kv_heads):
            live = None  # the key is seen by some query head of the group
            for n in range(kv * plan.q_heads_per_kv_head, (kv + 1) * plan.q_heads_per_kv_head):
                head = tile.live(extras.live_k, n)
                live = head if live is None else jnp.maximum(live, head)
            dk, dv = dk_scr[kv] * plan.scale, dv_scr[kv]
            if live is not None:  # keys no query sees were zeroed: no gradient reaches them
                dk, dv = (jnp.where(live != 0, x, 0.0) for x in (dk, dv))
            dks.append(dk)
            dvs.append(dv)
        cat = lambda xs: xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis=1)
        dk_ref[...] = cat(dks).astype(dk_ref.dtype)
        dv_ref[...] = cat(dvs).astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, plan: Plan):
    pl, _ = _pallas()
    bias_refs, extras, (dq_ref, dq_scr) = _split(plan, refs)
    b, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    tile = _Tile(plan, i, j, b, bias_refs, extras)

    @pl.when(j == 0)
    def _():
        dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

    def step():
        steps = _grad_step(plan, tile, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref)
        for n, _, kn, _, _, ds in steps:
            dq_scr[n] += _dot(ds.astype(kn.dtype), kn, _NN, plan)

    tile.when_allowed(step)

    @pl.when(j == pl.num_programs(2) - 1)
    def _():
        dqs = []
        for n in range(plan.heads):
            live = tile.live(extras.live_q, n)
            dq = dq_scr[n] * plan.scale
            dqs.append(dq if live is None else jnp.where(live != 0, dq, 0.0))
        dq = dqs[0] if len(dqs) == 1 else jnp.concatenate(dqs, axis=1)
        dq_ref[...] = dq.astype(dq_ref.dtype)


def _partial_shape(plan: Plan, shape):
    """A bias's gradient partials [B|1, N|1, q blocks|1, k blocks|1, T|1, S|1]: one per query
    block where the bias is broadcast over T, one per key block where it is broadcast over S and
    per row (its tile is revisited only after other rows')."""
    b0, n0, t0, s0 = shape
    return (
        b0,
        n0,
        plan.q_blocks if t0 == 1 else 1,
        plan.k_blocks if s0 == 1 and b0 > 1 else 1,
        plan.q_len if t0 > 1 else 1,
        plan.k_len if s0 > 1 else 1,
    )


def _dbias_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, plan: Plan):
    pl, _ = _pallas()
    bias_refs, extras, out_refs = _split(plan, refs)
    i, j, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    tile = _Tile(plan, i, j, b, bias_refs, extras)
    # Every tile runs (a tile the structure masks whole gives zeros): each writes its partial.
    sums = [[] for _ in out_refs]  # per bias: its per-head tiles, or one summed over heads
    steps = _grad_step(plan, tile, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref)
    for *_, ds in steps:
        for tiles, shape in zip(sums, plan.bias_shapes, strict=True):
            g = ds
            if shape[2] == 1:
                g = jnp.sum(g, axis=0, keepdims=True)
            if shape[3] == 1:
                g = jnp.sum(g, axis=1, keepdims=True)
            if shape[1] > 1 or not tiles:
                tiles.append(g)
            else:
                tiles[0] = tiles[0] + g
    for ref, shape, tiles in zip(out_refs, plan.bias_shapes, sums, strict=True):
        value = jnp.stack(tiles)  # [N|1, bq|1, bk|1]
        if shape[0] > 1:  # a per-row bias: this step owns the tile
            ref[...] = value
            continue
        first = b == 0 if shape[3] > 1 else (b == 0) & (j == 0)

        @pl.when(first)
        def _(ref=ref, value=value):
            ref[...] = value

        @pl.when(jnp.logical_not(first))
        def _(ref=ref, value=value):
            ref[...] += value


def _dbias(plan: Plan, common):
    pl, _ = _pallas()
    order = "ijb"
    out_specs, out_shape = [], []
    for shape in plan.bias_shapes:
        full = _partial_shape(plan, shape)
        b0, n0, t0, s0 = shape
        out_shape.append(jax.ShapeDtypeStruct(full, jnp.float32))
        out_specs.append(
            pl.BlockSpec(
                (
                    None,
                    n0,
                    None,
                    None,
                    plan.block_q if t0 > 1 else 1,
                    plan.block_k if s0 > 1 else 1,
                ),
                lambda i, j, b, shape=shape, full=full: (
                    b if shape[0] > 1 else 0,
                    0,
                    i if full[2] > 1 else 0,
                    j if full[3] > 1 else 0,
                    i if shape[2] > 1 else 0,
                    j if shape[3] > 1 else 0,
                ),
            )
        )
    partials = plan.call(
        functools.partial(_dbias_kernel, plan=plan),
        (plan.q_blocks, plan.k_blocks, plan.batch),
        plan.common_specs(order, with_grads=True),
        out_specs,
        tuple(out_shape),
        [],
        ("parallel", "parallel", "arbitrary"),
        common,
        "gated_attention_tpu_dbias",
    )
    return [
        jnp.sum(p, axis=(2, 3)).reshape(shape)
        for p, shape in zip(partials, plan.bias_shapes, strict=True)
    ]


def backward(plan, residuals, cotangents):
    pl, pltpu = _pallas()
    q, k, v, biases, extras, out, lse = residuals
    d_out, d_lse = cotangents
    n, hv = plan.heads, plan.value_dim
    shape = (plan.batch, plan.q_len, n, hv)
    # [B, N, T]: rowsum(dO * O), the softmax backward's correction. A multiply and a reduce,
    # which XLA fuses (an einsum became a dot with a float32 copy of the output).
    product = out.reshape(shape).astype(jnp.float32) * d_out.reshape(shape).astype(jnp.float32)
    delta = jnp.sum(product, axis=-1).transpose(0, 2, 1)
    delta = delta - d_lse.astype(jnp.float32)  # d lse / d logits = p: ds = p * (dp - delta + d_lse)
    common = (q, k, v, d_out, lse, delta, *biases, *extras)
    kv = plan.kv_heads

    order = "bji"
    dk, dv = plan.call(
        functools.partial(_dkdv_kernel, plan=plan),
        (plan.batch, plan.k_blocks, plan.q_blocks),
        plan.common_specs(order, with_grads=True),
        [plan.rows_spec(order, "j", kv * plan.head_dim), plan.rows_spec(order, "j", kv * hv)],
        (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
        [
            pltpu.VMEM((kv, plan.block_k, plan.head_dim), jnp.float32),
            pltpu.VMEM((kv, plan.block_k, hv), jnp.float32),
        ],
        ("parallel", "parallel", "arbitrary"),
        common,
        "gated_attention_tpu_dkdv",
    )
    order = "bij"
    dq = plan.call(
        functools.partial(_dq_kernel, plan=plan),
        (plan.batch, plan.q_blocks, plan.k_blocks),
        plan.common_specs(order, with_grads=True),
        plan.rows_spec(order, "i", n * plan.head_dim),
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        [pltpu.VMEM((n, plan.block_q, plan.head_dim), jnp.float32)],
        ("parallel", "parallel", "arbitrary"),
        common,
        "gated_attention_tpu_dq",
    )
    dbiases = _dbias(plan, common) if biases else []
    dbiases = tuple(d.astype(b.dtype) for d, b in zip(dbiases, biases, strict=True))
    return dq, dk, dv, dbiases, tuple(None for _ in extras)
