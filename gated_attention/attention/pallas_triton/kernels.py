"""The Pallas GPU kernels (attention/pallas_triton/implementation.py's docstring: grids, numerics): the forward, the dk/dv kernel
and the dq/bias-gradient kernel, with the tile loads and logits they share (_Tiles: rows, bias and
mask tiles, the structure's key and query block ranges) and their launches, forward and backward,
the pair attention/pallas_triton/implementation.py makes a custom VJP of.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from gated_attention.attention.gpu_common import LOG2E, MASKED, softmax_delta, sum_bias_partials
from gated_attention.attention.pallas_triton.plan import Plan
from gated_attention.attention.pallas_triton.plan import pallas_modules as _pallas
from gated_attention.attention.pallas_triton.tile_table import _pow2_tile
from gated_attention.core import masking, numerics


def _dot(a, b, **kwargs):
    _, plgpu = _pallas()
    return plgpu.dot(a, b, **kwargs)


def _asm(plan: Plan, instruction: str, fallback, *args):
    """An elementwise float32 PTX instruction on same-shaped args (`fallback` in the interpreter
    and on ROCm): XLA's Triton emits mul.rn/add.rn, which ptxas never fuses, and __nv_exp2f's
    denormal-safe ex2.approx.f32, which costs three more instructions."""
    if not plan.ptx:
        return fallback(*args)
    _, plgpu = _pallas()
    args = jnp.broadcast_arrays(*(jnp.asarray(a, jnp.float32) for a in args))
    operands = ", ".join(f"${i + 1}" for i in range(len(args)))
    (out,) = plgpu.elementwise_inline_asm(
        f"{instruction} $0, {operands};",
        args=args,
        constraints="=r," + ",".join("r" for _ in args),
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, jnp.float32)],
    )
    return out


def _fma(plan: Plan, a, b, c):
    """a * b + c in one rounding (FFMA)."""
    return _asm(plan, "fma.rn.f32", lambda a, b, c: a * b + c, a, b, c)


def _exp2(plan: Plan, x):
    """2 ** x, subnormal results flushed to 0 (one MUFU.EX2; their weight is below 2**-126)."""
    return _asm(plan, "ex2.approx.ftz.f32", jnp.exp2, x)


def _scaled(plan: Plan, s, bias):
    """s * scale + bias: one FFMA in half precision (Plan.base2)."""
    return _fma(plan, s, plan.scale, bias) if plan.base2 else s * plan.scale + bias


def _weights(plan: Plan, s, shift):
    """exp(s - shift) ([bq, bk] logits, [bq] shifts: the row max or the log-sum-exp); with
    Plan.base2 exp2 of one FFMA."""
    if not plan.base2:
        return jnp.exp(s - shift[:, None])
    return _exp2(plan, _fma(plan, s, LOG2E, -(shift * LOG2E)[:, None]))


def _rescale(plan: Plan, m_prev, m):
    """exp(m_prev - m): the running sums' correction."""
    return _exp2(plan, (m_prev - m) * LOG2E) if plan.base2 else jnp.exp(m_prev - m)


def _widen(plan: Plan, x):
    """A tile as float32: bfloat16 by two bit operations per pair of values (LLVM's extension
    takes three), other dtypes by a cast."""
    if not (plan.ptx and plan.base2) or x.dtype != jnp.bfloat16:
        return x.astype(jnp.float32)
    _, plgpu = _pallas()
    (out,) = plgpu.elementwise_inline_asm(
        "{ shl.b32 $0, $2, 16; and.b32 $1, $2, -65536; }",
        args=[x],
        constraints="=r,=r,r",
        pack=2,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)],
    )
    return out


def _ds(start, size: int):
    """pl.ds with an int32 start (a Python int is int64 where jax_enable_x64 is set)."""
    pl, _ = _pallas()
    return pl.ds(jnp.asarray(start, jnp.int32), size)


def _index(ref, axis: int, i):
    """i along a ref's axis, or 0 where that axis is broadcast (size 1)."""
    return i if ref.shape[axis] > 1 else jnp.zeros((), jnp.int32)


# The slots of a packed q/k/v array (Plan.packed) and of its gradient; any after V are the
# caller's (packed_dot_product_attention), whose gradient the dk/dv kernel zeroes.
Q, K, V = 0, 1, 2


class _Extras(NamedTuple):
    """The optional refs after the biases (None where absent)."""

    mask: Any  # int8 [B|1, N|1, T|1, S|1]
    live_q: Any  # int8 [B|1, N|1, T|1]
    live_k: Any  # int8 [B|1, N|1, S|1]
    meta: Any  # int32 [B, 3] (masking.StructuredMask.meta)


class _Structure(NamedTuple):
    """One batch row's causal, window and length masks, read from the meta ref."""

    offset: Any  # the position of local query 0
    q_length: Any
    kv_length: Any


class _Tiles:
    """Loads of one program's tiles: q/k/v rows of one batch row and head, bias and mask tiles."""

    def __init__(self, plan: Plan, batch: int, q_len: int, k_len: int, n_bias: int):
        self.plan, self.batch, self.q_len, self.k_len = plan, batch, q_len, k_len
        self.n_bias = n_bias

    def at(self, ref, b, index, n, padded: int, slot: int | None = None):
        """The view of ref [B, L, N, D] ([L, B, N, D] with Plan.columns) at batch row b, the rows
        `index` and head n, padded columns; `slot` of a packed [B, L, 3, N, D] ref (Plan.packed:
        q, k, v and their gradients; None for the arrays that are never packed)."""
        rows = (index, b) if self.plan.columns else (b, index)
        slots = (jnp.int32(slot),) if self.plan.packed and slot is not None else ()
        return ref.at[(*rows, *slots, n, _ds(0, padded))]

    def split(self, refs):
        """refs after q, k, v (and any per-kernel ones) -> (bias refs, _Extras, rest)."""
        plan = self.plan
        biases, rest = refs[: self.n_bias], list(refs[self.n_bias :])
        take = lambda present: rest.pop(0) if present else None
        mask = take(plan.has_mask)
        live_q, live_k = take(plan.has_live), take(plan.has_live)
        meta = take(plan.structured)
        return biases, _Extras(mask, live_q, live_k, meta), tuple(rest)

    def structure(self, extras: _Extras, b):
        """Batch row b's _Structure, or None when there is no causal, window or length mask."""
        if extras.meta is None:
            return None
        return _Structure(extras.meta[b, 0], extras.meta[b, 1], extras.meta[b, 2])

    def key_blocks(self, st: _Structure | None, i):
        """[lo, hi): the key blocks that some query of query block i may attend (all without a
        structure): the loops skip the tiles the structure masks whole."""
        plan = self.plan
        if st is None:
            return 0, -(-self.k_len // plan.block_k)
        return masking.key_tiles(
            st.offset + i * plan.block_q, plan.block_q, plan.block_k, plan.causal, plan.window,
            self.k_len, st.q_length, st.kv_length,
        )  # fmt: skip

    def query_blocks(self, st: _Structure | None, j):
        """[lo, hi): the query blocks with some query that may attend a key of key block j."""
        plan = self.plan
        if st is None:
            return 0, -(-self.q_len // plan.block_q)
        return masking.query_tiles(
            j * plan.block_k, plan.block_k, plan.block_q, plan.causal, plan.window, st.offset,
            self.q_len, st.q_length, st.kv_length,
        )  # fmt: skip

    def span(self, index: int, block: int, length: int):
        pl, _ = _pallas()
        ids = index * block + jnp.arange(block, dtype=jnp.int32)
        return _ds(index * block, block), ids < length

    def rows(self, ref, b, span, n, width: int, live=None, slot: int | None = None):
        """ref [B, L, N, D] (at; `slot` of a packed one) rows span of batch row b and head n ->
        [block, padded D], cast to compute."""
        pl, plgpu = _pallas()
        index, ok = span
        padded = _pow2_tile(width)
        mask = ok[:, None] & (jnp.arange(padded, dtype=jnp.int32) < width)[None, :]
        x = plgpu.load(self.at(ref, b, index, n, padded, slot), mask=mask, other=0)
        x = x.astype(self.plan.compute_dtype)
        if live is not None:
            x = jnp.where(live[:, None] != 0, x, jnp.zeros((), x.dtype))
        return x

    def queries(self, q_ref, extras, b, n, q_span):
        """(q [bq, padded H] with dead queries zeroed, live_q or None) of one query block."""
        live_q = None if extras.live_q is None else self.vector(extras.live_q, b, n, q_span)
        return self.rows(q_ref, b, q_span, n, self.plan.head_dim, live_q, Q), live_q

    def keys_values(self, k_ref, v_ref, extras, b, n, k_span, zero_keys: bool = True):
        """(k, v of key/value head n // group with the keys query head n does not see zeroed,
        live_k or None) of one key block. zero_keys=False leaves k as it is: the forward masks
        every logit of a dead key, and only dq's product ds @ k would carry a non-finite key."""
        live_k = None if extras.live_k is None else self.vector(extras.live_k, b, n, k_span)
        kv = n // self.plan.q_heads_per_kv_head
        k_live = live_k if zero_keys else None
        k = self.rows(k_ref, b, k_span, kv, self.plan.head_dim, k_live, K)
        v = self.rows(v_ref, b, k_span, kv, self.plan.value_dim, live_k, V)
        return k, v, live_k

    def store_rows(self, ref, b, span, n, width: int, x, slot: int | None = None):
        pl, plgpu = _pallas()
        index, ok = span
        padded = _pow2_tile(width)
        mask = ok[:, None] & (jnp.arange(padded, dtype=jnp.int32) < width)[None, :]
        plgpu.store(self.at(ref, b, index, n, padded, slot), x.astype(ref.dtype), mask=mask)

    @staticmethod
    def vector(ref, b, n, span, other=0):
        """ref [B|1, N|1, L|1] at (b, n, span) -> [block] (or [1] for a broadcast L)."""
        pl, plgpu = _pallas()
        bb, nn = _index(ref, 0, b), _index(ref, 1, n)
        index, ok = span
        if ref.shape[2] == 1:
            return plgpu.load(ref.at[bb, nn, _ds(0, 1)])
        return plgpu.load(ref.at[bb, nn, index], mask=ok, other=other)

    @staticmethod
    def tile(ref, b, n, q_span, k_span, other=0):
        """ref [B|1, N|1, T|1, S|1] at (b, n, q_span, k_span) -> [bq|1, bk|1]."""
        pl, plgpu = _pallas()
        bb, nn = _index(ref, 0, b), _index(ref, 1, n)
        (q_index, q_ok), (k_index, k_ok) = q_span, k_span
        mask = None
        if ref.shape[2] > 1:
            mask = q_ok[:, None]
        else:
            q_index = _ds(0, 1)
        if ref.shape[3] > 1:
            mask = k_ok[None, :] if mask is None else mask & k_ok[None, :]
        else:
            k_index = _ds(0, 1)
        if mask is None:  # a [.., 1, 1] bias: Triton's load takes `other` only with a mask
            return plgpu.load(ref.at[bb, nn, q_index, k_index])
        return plgpu.load(ref.at[bb, nn, q_index, k_index], mask=mask, other=other)

    def allowed(self, st: _Structure, q_span, k_span):
        """bool [bq, bk]: the causal, window and length masks of a tile (masking.allowed)."""
        plan = self.plan
        q_start, k_start = q_span[0].start, k_span[0].start
        qi = st.offset + q_start + jnp.arange(plan.block_q, dtype=jnp.int32)[:, None]
        kj = k_start + jnp.arange(plan.block_k, dtype=jnp.int32)[None, :]
        return masking.allowed(qi, kj, plan.causal, plan.window, st.q_length, st.kv_length)

    def shared_bias_tiles(self, bias_refs, n, q_span, k_span) -> list:
        """The float32 tiles of the biases shared over the batch (None for the others), loaded
        once for all the rows of a program."""
        zero = jnp.zeros((), jnp.int32)
        return [
            _widen(self.plan, self.tile(ref, zero, n, q_span, k_span))
            if ref.shape[0] == 1
            else None
            for ref in bias_refs
        ]

    def logits(self, q, k, bias_refs, extras, st, b, n, q_span, k_span, shared=None):
        """Scaled, biased, soft-capped, masked float32 logits [bq, bk] (keys past the end -inf),
        and the soft cap's derivative there (None: no cap). `shared`: shared_bias_tiles'."""
        plan = self.plan
        s = _dot(q, k, trans_b=True, precision=plan.precision)
        for t, ref in enumerate(bias_refs):
            tile = None if shared is None else shared[t]
            if tile is None:  # loaded beside its use: ptxas's registers (test_kernel_compiles)
                tile = _widen(plan, self.tile(ref, b, n, q_span, k_span))
            s = _scaled(plan, s, tile) if t == 0 else s + tile
        s = s if bias_refs else s * plan.scale
        cap_grad = None
        if plan.soft_cap is not None:
            t = jnp.tanh(s * (1.0 / plan.soft_cap))
            inside = q_span[1][:, None] & k_span[1][None, :]  # bias loads past the end give 0
            s, cap_grad = plan.soft_cap * t, jnp.where(inside, 1.0 - t * t, 0.0)
        if extras.mask is not None:
            keep = self.tile(extras.mask, b, n, q_span, k_span) != 0
            s = jnp.where(keep, s, MASKED)
        if st is not None:
            s = jnp.where(self.allowed(st, q_span, k_span), s, MASKED)
        return jnp.where(k_span[1][None, :], s, -jnp.inf), cap_grad


def _forward_kernel(q_ref, k_ref, v_ref, *refs, tiles: _Tiles):
    """Rows g * R .. g * R + R - 1 (R = plan.rows_per_program; in the last group, rows past the
    batch repeat its last row: the same values stored twice) of head n, query block i."""
    pl, plgpu = _pallas()
    plan = tiles.plan
    bias_refs, extras, (o_ref, lse_ref) = tiles.split(refs)
    g, n, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    per = plan.rows_per_program
    last = tiles.batch - 1
    rows = [g] if per == 1 else [jnp.minimum(g * per + r, last) for r in range(per)]
    q_span = tiles.span(i, plan.block_q, tiles.q_len)
    queries = [tiles.queries(q_ref, extras, b, n, q_span)[0] for b in rows]
    st = tiles.structure(extras, rows[0])  # several rows only without a structure (Plan.make)

    def row_step(b, q, carry, k_span, shared):
        acc, m_prev, l_prev = carry
        # k unzeroed saves 0.8 instructions a score (Plan.base2: where it spilled nothing).
        zero_keys = not plan.base2
        k, v, _ = tiles.keys_values(k_ref, v_ref, extras, b, n, k_span, zero_keys=zero_keys)
        s, _ = tiles.logits(q, k, bias_refs, extras, st, b, n, q_span, k_span, shared)
        m = jnp.maximum(m_prev, jnp.max(s, axis=1))
        correction = _rescale(plan, m_prev, m)
        p = _weights(plan, s, m)
        acc = acc * correction[:, None] + _dot(p.astype(v.dtype), v, precision=plan.precision)
        return acc, m, l_prev * correction + jnp.sum(p, axis=1)

    def body(j, carry):
        k_span = tiles.span(j, plan.block_k, tiles.k_len)
        shared = None if per == 1 else tiles.shared_bias_tiles(bias_refs, n, q_span, k_span)
        return tuple(
            row_step(b, q, c, k_span, shared) for b, q, c in zip(rows, queries, carry, strict=True)
        )

    init = (
        jnp.zeros((plan.block_q, _pow2_tile(plan.value_dim)), jnp.float32),
        jnp.full((plan.block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((plan.block_q,), jnp.float32),
    )
    results = lax.fori_loop(*tiles.key_blocks(st, i), body, tuple(init for _ in rows))
    for b, (acc, m, total) in zip(rows, results, strict=True):
        if st is not None:  # a row whose every key block was skipped: 0 and a finite lse
            seen = total > 0
            total = jnp.where(seen, total, 1.0)
            m = jnp.where(seen, m, numerics.MASK_VALUE)
        tiles.store_rows(o_ref, b, q_span, n, plan.value_dim, acc / total[:, None])
        plgpu.store(lse_ref.at[b, n, q_span[0]], m + jnp.log(total), mask=q_span[1])


def _grads(tiles, q, k, v, do, lse, delta, bias_refs, extras, st, b, n, q_span, k_span):
    """(p, ds) of one tile: the recomputed softmax weights (zero on rows past the end) and the
    gradient of the logits before the soft cap."""
    plan = tiles.plan
    s, cap_grad = tiles.logits(q, k, bias_refs, extras, st, b, n, q_span, k_span)
    p = _weights(plan, s, lse)
    p = jnp.where(q_span[1][:, None], p, 0.0)
    dp = _dot(do, v, trans_b=True, precision=plan.precision)
    ds = p * (dp - delta[:, None])
    return p, ds if cap_grad is None else ds * cap_grad


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, tiles: _Tiles):
    """dk, dv of one key block of key/value head `kv`, summed over its group's query heads."""
    pl, _ = _pallas()
    plan = tiles.plan
    bias_refs, extras, outs = tiles.split(refs)
    dk_ref, dv_ref = outs * 2 if plan.packed else outs  # packed: one [B, S, 3, K, D] gradient
    b, kv, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    k_span = tiles.span(j, plan.block_k, tiles.k_len)
    operands = (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref)
    dk, dv, seen = key_block_grads(tiles, operands, bias_refs, extras, b, kv, j, k_span)
    store_dkdv(tiles, dk_ref, dv_ref, b, k_span, kv, dk, dv, seen)


def key_block_grads(tiles: _Tiles, operands, bias_refs, extras, b, kv, j, k_span, each_tile=None,
                    each_head=None):  # fmt: skip
    """(dk, dv, seen) of key block j of key/value head kv for batch row b: float32, summed over
    the group's query heads and the query blocks the structure leaves; `seen` the keys some
    query head sees (None: all). operands: the (q, k, v, dO, lse, delta) refs.
    each_tile(n, i, q_span, live_q, k, ds) runs after each tile's products, each_head(n, lo,
    hi) after a head's loop over query blocks [lo, hi) (the fused backward's dq partials)."""
    plan = tiles.plan
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = operands
    st = tiles.structure(extras, b)
    lo, hi = tiles.query_blocks(st, j)
    dk = jnp.zeros((plan.block_k, _pow2_tile(plan.head_dim)), jnp.float32)
    dv = jnp.zeros((plan.block_k, _pow2_tile(plan.value_dim)), jnp.float32)
    seen = None  # keys some query head of the group sees
    for g in range(plan.q_heads_per_kv_head):
        n = kv * plan.q_heads_per_kv_head + g
        k, v, live_k = tiles.keys_values(k_ref, v_ref, extras, b, n, k_span)
        if live_k is not None:
            seen = live_k if seen is None else jnp.maximum(seen, live_k)

        def body(i, carry, n=n, k=k, v=v):
            dk, dv = carry
            q_span = tiles.span(i, plan.block_q, tiles.q_len)
            q, live_q = tiles.queries(q_ref, extras, b, n, q_span)
            do = tiles.rows(do_ref, b, q_span, n, plan.value_dim)
            lse = tiles.vector(lse_ref, b, n, q_span)
            delta = tiles.vector(delta_ref, b, n, q_span)
            p, ds = _grads(tiles, q, k, v, do, lse, delta, bias_refs, extras, st, b, n, q_span,
                           k_span)  # fmt: skip
            dv = dv + _dot(p.astype(do.dtype), do, trans_a=True, precision=plan.precision)
            dk = dk + _dot(ds.astype(q.dtype), q, trans_a=True, precision=plan.precision)
            if each_tile is not None:
                each_tile(n, i, q_span, live_q, k, ds)
            return dk, dv

        dk, dv = lax.fori_loop(lo, hi, body, (dk, dv))
        if each_head is not None:
            each_head(n, lo, hi)
    return dk, dv, seen


def store_dkdv(tiles: _Tiles, dk_ref, dv_ref, b, k_span, kv, dk, dv, seen):
    """Stores one key block's dk (times the scale) and dv of batch row b, key/value head kv,
    zero where no query head of the group sees a key (`seen`, or None), and zero in a packed
    gradient's slots after V (the caller's)."""
    plan = tiles.plan
    dk = dk * plan.scale
    if seen is not None:  # keys no query sees were zeroed: no gradient reaches them
        dk, dv = (jnp.where(seen[:, None] != 0, x, 0.0) for x in (dk, dv))
    tiles.store_rows(dk_ref, b, k_span, kv, plan.head_dim, dk, K)
    tiles.store_rows(dv_ref, b, k_span, kv, plan.value_dim, dv, V)
    for slot in range(V + 1, dk_ref.shape[-3] if plan.packed else 0):  # the caller's: zero
        tiles.store_rows(dk_ref, b, k_span, kv, plan.head_dim, jnp.zeros_like(dk), slot)


def accumulate_bias_grad(ref, shape, slot, n, q_span, i, k_span, j, ds):
    """Adds ds, reduced to the bias's broadcast dims, into the tile (slot, n, q_span, k_span) of
    a float32 bias-gradient buffer that one program owns: a bias without T takes row i (query
    block i's partial), one without S column j (key block j's; 0 where one program walks them
    all)."""
    _, plgpu = _pallas()
    (q_index, q_ok), (k_index, k_ok) = q_span, k_span
    mask = None
    if shape[2] > 1:
        mask = q_ok[:, None]
    else:  # one partial row per query block
        ds, q_index = jnp.sum(ds, axis=0, keepdims=True), _ds(i, 1)
    if shape[3] > 1:
        mask = k_ok[None, :] if mask is None else mask & k_ok[None, :]
    else:
        ds, k_index = jnp.sum(ds, axis=1, keepdims=True), _ds(j, 1)
    view = ref.at[slot, n, q_index, k_index]
    old = plgpu.load(view) if mask is None else plgpu.load(view, mask=mask, other=0.0)
    plgpu.store(view, old + ds, mask=mask)


def _dq_dbias_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, tiles: _Tiles, shapes: tuple
):
    """dq of one query block of every row of a group; the bias gradients it owns (module doc)."""
    pl, plgpu = _pallas()
    plan = tiles.plan
    bias_refs, extras, rest = tiles.split(refs)
    # The zero-filled buffers (and a packed gradient's dk/dv) aliased to the outputs below.
    rest = rest[len(shapes) + plan.packed :]
    dq_ref, dbias_refs = rest[0], rest[1:]
    g, n, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    batch = tiles.batch
    q_span = tiles.span(i, plan.block_q, tiles.q_len)

    def row(r, carry):
        b = g + plan.row_groups * r
        st = tiles.structure(extras, b)
        q, live_q = tiles.queries(q_ref, extras, b, n, q_span)
        do = tiles.rows(do_ref, b, q_span, n, plan.value_dim)
        lse = tiles.vector(lse_ref, b, n, q_span)
        delta = tiles.vector(delta_ref, b, n, q_span)

        def body(j, dq):
            k_span = tiles.span(j, plan.block_k, tiles.k_len)
            k, v, _ = tiles.keys_values(k_ref, v_ref, extras, b, n, k_span)
            _, ds = _grads(tiles, q, k, v, do, lse, delta, bias_refs, extras, st, b, n, q_span,
                           k_span)  # fmt: skip
            for ref, shape in zip(dbias_refs, shapes, strict=True):
                slot = b if shape[0] > 1 else g
                accumulate_bias_grad(ref, shape, slot, n, q_span, i, k_span, 0, ds)
            return dq + _dot(ds.astype(k.dtype), k, precision=plan.precision)

        init = jnp.zeros((plan.block_q, _pow2_tile(plan.head_dim)), jnp.float32)
        # Skipped key blocks leave the zero-filled bias-gradient buffers as they are.
        dq = lax.fori_loop(*tiles.key_blocks(st, i), body, init) * plan.scale
        if live_q is not None:
            dq = jnp.where(live_q[:, None] != 0, dq, 0.0)
        tiles.store_rows(dq_ref, b, q_span, n, plan.head_dim, dq, Q)
        return carry

    rows = (batch - g + plan.row_groups - 1) // plan.row_groups  # rows g, g + groups, ... < batch
    lax.fori_loop(0, rows, row, 0)


def _lengths(plan: Plan, q, k) -> tuple[int, int, int]:
    """(B, T, S) of q [B, T, N, H] and k [B, S, K, H] (Plan.columns: [T, B, N, H], [S, B, K, H];
    Plan.packed: [.., 3, N, H])."""
    (batch, q_len), k_len = q.shape[:2], k.shape[1]
    return (q_len, batch, k.shape[0]) if plan.columns else (batch, q_len, k_len)


def forward(plan: Plan, q, k, v, biases, extras):
    batch, q_len, k_len = _lengths(plan, q, k)
    heads = q.shape[-2]
    tiles = _Tiles(plan, batch, q_len, k_len, len(biases))
    grid = (
        -(-batch // plan.rows_per_program),
        heads,
        -(-q_len // plan.block_q),
    )  # batch rows vary fastest: bias tiles stay in L2
    out_shape = (
        jax.ShapeDtypeStruct((*q.shape[:2], heads, v.shape[-1]), q.dtype),
        jax.ShapeDtypeStruct((batch, heads, q_len), jnp.float32),
    )
    args = (q, k, v, *biases, *extras)
    kernel = functools.partial(_forward_kernel, tiles=tiles)
    return plan.call(kernel, grid, out_shape, args, "gated_attention_forward")


def bias_grad_buffers(plan: Plan, shapes, batch, heads, q_len, k_len, k_parts: int) -> tuple:
    """Zero-filled float32 bias-gradient buffers [B or row groups, N, T or query blocks, S or
    k_parts] (k_parts: per key block where programs split the keys, else 1)."""
    q_blocks = -(-q_len // plan.block_q)
    return tuple(
        jnp.zeros(
            (
                batch if s[0] > 1 else plan.row_groups,
                heads,
                q_len if s[2] > 1 else q_blocks,
                k_len if s[3] > 1 else k_parts,
            ),
            jnp.float32,
        )
        for s in shapes
    )


def backward(plan, residuals, cotangents):
    q, k, v, biases, extras, out, lse = residuals
    d_out, d_lse = cotangents
    batch, q_len, k_len = _lengths(plan, q, k)
    heads = q.shape[-2]
    tiles = _Tiles(plan, batch, q_len, k_len, len(biases))
    delta = softmax_delta(out, d_out, d_lse, plan.columns)  # [B, N, T]
    common = (q, k, v, d_out, lse, delta, *biases, *extras)

    dkdv_shapes = (k, v) if not plan.packed else (q,)  # packed: slots 1 and 2 of one array
    dkdv = plan.call(
        functools.partial(_dkdv_kernel, tiles=tiles),
        (batch, plan.kv_heads, -(-k_len // plan.block_k)),
        tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in dkdv_shapes),
        common,
        "gated_attention_dkdv",
    )

    q_blocks = -(-q_len // plan.block_q)
    shapes = tuple(tuple(b.shape) for b in biases)
    buffers = bias_grad_buffers(plan, shapes, batch, heads, q_len, k_len, 1)
    first_buffer = len(common)
    aliases = {first_buffer + t: 1 + t for t in range(len(buffers))}
    if plan.packed:  # dq written into slot 0 of the dk/dv kernel's packed gradient, in place
        aliases[first_buffer + len(buffers)] = 0
    dq, *partials = plan.call(
        functools.partial(_dq_dbias_kernel, tiles=tiles, shapes=shapes),
        (plan.row_groups, heads, q_blocks),
        (
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in buffers),
        ),
        (*common, *buffers, *(dkdv if plan.packed else ())),
        "gated_attention_dq_dbias",
        aliases=aliases,
    )
    dk, dv = (None, None) if plan.packed else dkdv
    return dq, dk, dv, sum_bias_partials(biases, partials), tuple(None for _ in extras)
