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

Numerics follow numerics.py: logits, softmax and accumulation in float32; masked logits are
selected to MASK_VALUE (a fully masked row is then uniform); queries with no key and keys no query
sees are zeroed as they are loaded (so masked garbage never leaks), and fully masked rows get the
uniform average of the values as given. float32 dots follow JAX's matmul precision as XLA's do on
a GPU (dot_precision): TF32 tensor-core MMAs by default, three TF32 passes at 'high', IEEE at
'highest'. Head dims up to 128 are padded inside the tiles to a power of two of at least 16
(Triton's smallest dot); sequence lengths need not be multiples of the blocks (masked loads).

`interpret=True` runs the same kernels in Pallas's interpreter on any backend: how they are tested
on machines without a GPU. Without it the kernels run on GPU only (check() says so elsewhere).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from gated_attention import base, checks, masking, numerics, pallas_tiles
from gated_attention.pallas_tiles import (
    MIN_TILE,
    SHARED_MEMORY_LIMIT,
    _pow2_tile,
    kernel_form,
    shared_memory_estimate,
)

DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_HEAD_DIM = 128


def _pallas():
    # Imported on first use: `import gated_attention` stays free of Pallas's import time.
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    return pl, plgpu


def _dot(a, b, **kwargs):
    _, plgpu = _pallas()
    return plgpu.dot(a, b, **kwargs)


def _ds(start, size: int):
    """pl.ds with an int32 start (a Python int is int64 where jax_enable_x64 is set)."""
    pl, _ = _pallas()
    return pl.ds(jnp.asarray(start, jnp.int32), size)


def _index(ref, axis: int, i):
    """i along a ref's axis, or 0 where that axis is broadcast (size 1)."""
    return i if ref.shape[axis] > 1 else jnp.zeros((), jnp.int32)


def _extra_options(options, query, key) -> bool:
    """Whether the call asks for more than plain attention in the kernels' registers (the
    residual and precision cost none)."""
    return bool(options.asked(query, key).keys() - {"precision", "return_residual"})


# jax_default_matmul_precision's names -> the three levels of lax.Precision.
_PRECISION_NAMES = {
    "default": "default",
    "fastest": "default",
    "bfloat16": "default",
    "high": "high",
    "tensorfloat32": "high",
    "bfloat16_3x": "high",
    "highest": "highest",
    "float32": "highest",
}


def dot_precision(precision, compute_dtype, interpret: bool):
    """The float32 dots' precision, as XLA's own float32 dots on a GPU follow JAX's: the call's
    `precision`, else jax_default_matmul_precision, else DEFAULT. DEFAULT is one TF32 pass on the
    tensor cores (about 1e-3 relative error, what AF2's einsums get on a GPU), HIGH three TF32
    passes (near float32), HIGHEST IEEE float32 (scalar FMAs: slow). Half precision: None. In the
    interpreter (on CPU, where there is no TF32) every level computes in float32."""
    if jnp.dtype(compute_dtype) != jnp.float32:
        return None
    if precision is None:
        precision = jax.config.jax_default_matmul_precision
    if isinstance(precision, tuple):
        precision = max(precision, key=lambda p: p.value)
    if isinstance(precision, lax.Precision):
        level = precision.name.lower()
    else:
        level = _PRECISION_NAMES.get(str(precision).lower(), "highest") if precision else "default"
    if level == "highest" or interpret:
        return lax.Precision.HIGHEST
    if level == "high":
        return lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    return lax.Precision.DEFAULT


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
      interpret: run the kernels in Pallas's interpreter (any backend; slow, for tests).
    """

    name = "pallas"
    block_q: int | None = None
    block_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    bias_grad_programs: int = 512
    interpret: bool = False

    TAKES = base.ALL_OPTIONS

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            value = checks.check_int(name, getattr(self, name), minimum=MIN_TILE, optional=True)
            if value is not None and value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= {MIN_TILE}, got {value}")
        checks.check_int("num_warps", self.num_warps, optional=True)
        checks.check_int("num_stages", self.num_stages, optional=True)
        checks.check_int("bias_grad_programs", self.bias_grad_programs)
        checks.check_bool("interpret", self.interpret)

    def check(
        self, query, key, value, biases, mask, *, compute_dtype, options=base.PLAIN, platform=None
    ):
        super().check(query, key, value, biases, mask, compute_dtype=compute_dtype, options=options)
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
        precision = dot_precision(options.precision, compute_dtype, self.interpret)
        extra = _extra_options(options, query, key)
        form = kernel_form(biases, mask)
        block_q, block_k, _, stages = self.tiles(compute_dtype, precision, max(dims), extra, form)
        need = shared_memory_estimate(
            block_q, block_k, stages, max(dims), compute_dtype, biases, mask is not None
        )
        if need > SHARED_MEMORY_LIMIT:
            raise NotImplementedError(
                f"tiles {block_q} x {block_k} with {stages} stages need about {need:,} bytes of "
                f"shared memory at head dim {max(dims)} ({jnp.dtype(compute_dtype)}), over the "
                f"{SHARED_MEMORY_LIMIT:,} an A100 block has: take smaller tiles"
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
        self, query, key, value, biases, mask, *, scale, compute_dtype, options=base.PLAIN
    ):
        structure = options.structure
        q_len, k_len = query.shape[1], key.shape[1]
        # Live queries [B|1, N|1, T|1] and keys [B|1, N|1, S|1] under the mask and the structure.
        live_q, live_k = structure.live(mask, q_len, k_len)
        extras = []
        if mask is not None:
            extras.append(mask.astype(jnp.int8))  # int8 for Triton
        if live_q is not None:
            extras += [live_q.astype(jnp.int8), live_k.astype(jnp.int8)]
        if not structure.trivial:
            extras.append(structure.meta(query.shape[0]))
        precision = dot_precision(options.precision, compute_dtype, self.interpret)
        plan = _Plan.make(
            self, query, key, value, biases, scale, compute_dtype, precision, mask, live_q, options
        )
        out, lse = _attention(plan, query, key, value, tuple(biases), tuple(extras))
        return numerics.finish_rows_without_key(out, lse, value, live_q, options.return_residual)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static facts of one call, shared by the three kernels (hashable: a custom_vjp argument)."""

    scale: float
    compute_dtype: str
    block_q: int
    block_k: int
    head_dim: int
    value_dim: int
    groups: int  # batch-row groups of the dq/bias-gradient kernel
    num_warps: int
    num_stages: int
    precision: Any
    interpret: bool
    heads: int
    kv_heads: int
    has_mask: bool
    has_live: bool
    causal: bool
    window: tuple | None  # (left, right)
    structured: bool  # causal, window or lengths: the [B, 3] meta ref (Structure.meta)
    soft_cap: float | None

    @property
    def group(self) -> int:
        """Query heads per key/value head: head n reads key/value head n // group."""
        return self.heads // self.kv_heads

    @classmethod
    def make(
        cls,
        impl: PallasAttention,
        query,
        key,
        value,
        biases,
        scale,
        compute_dtype,
        precision,
        mask=None,
        live_q=None,
        options=base.PLAIN,
    ):
        batch, q_len, heads, head_dim = query.shape
        k_len, value_dim = key.shape[1], value.shape[-1]
        padded = max(_pow2_tile(head_dim), _pow2_tile(value_dim))
        extra = _extra_options(options, query, key)
        form = kernel_form(biases, mask)
        tile_q, tile_k, num_warps, num_stages = impl.tiles(
            compute_dtype, precision, padded, extra, form
        )
        block_q = min(tile_q, _pow2_tile(q_len))
        groups = batch
        if any(b.shape[0] == 1 for b in biases) and batch > 1:
            programs_per_row = heads * -(-q_len // block_q)
            groups = min(batch, max(1, -(-impl.bias_grad_programs // programs_per_row)))
        return cls(
            scale=float(scale),
            compute_dtype=jnp.dtype(compute_dtype).name,
            block_q=block_q,
            block_k=min(tile_k, _pow2_tile(k_len)),
            head_dim=head_dim,
            value_dim=value_dim,
            groups=groups,
            num_warps=num_warps,
            num_stages=num_stages,
            precision=precision,
            interpret=impl.interpret,
            heads=heads,
            kv_heads=key.shape[2],
            has_mask=mask is not None,
            has_live=live_q is not None,
            causal=options.structure.is_causal,
            window=options.structure.window,
            structured=not options.structure.trivial,
            soft_cap=options.logits_soft_cap,
        )

    def call(self, kernel, grid, out_shape, args, name, aliases=None):
        pl, plgpu = _pallas()
        return pl.pallas_call(
            kernel,
            grid=grid,
            out_shape=out_shape,
            input_output_aliases=aliases or {},
            compiler_params=plgpu.CompilerParams(
                num_warps=self.num_warps, num_stages=self.num_stages
            ),
            interpret=self.interpret,
            name=name,
        )(*args)


class _Extras(NamedTuple):
    """The optional refs after the biases (None where absent)."""

    mask: Any  # int8 [B|1, N|1, T|1, S|1]
    live_q: Any  # int8 [B|1, N|1, T|1]
    live_k: Any  # int8 [B|1, N|1, S|1]
    meta: Any  # int32 [B, 3] (masking.Structure.meta)


class _Structure(NamedTuple):
    """One batch row's causal, window and length masks, read from the meta ref."""

    offset: Any  # the position of local query 0
    q_length: Any
    kv_length: Any


class _Tiles:
    """Loads of one program's tiles: q/k/v rows of one batch row and head, bias and mask tiles."""

    def __init__(self, plan: _Plan, q_len: int, k_len: int, n_bias: int):
        self.plan, self.q_len, self.k_len = plan, q_len, k_len
        self.n_bias = n_bias

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
        first = st.offset + i * plan.block_q
        lo, hi = masking.key_span(
            first, first + plan.block_q - 1, plan.causal, plan.window, self.k_len, st.q_length,
            st.kv_length,
        )  # fmt: skip
        return masking.tiles(lo, hi, plan.block_k)

    def query_blocks(self, st: _Structure | None, j):
        """[lo, hi): the query blocks with some query that may attend a key of key block j."""
        plan = self.plan
        if st is None:
            return 0, -(-self.q_len // plan.block_q)
        k_first = j * plan.block_k
        lo, hi = masking.query_span(
            k_first, k_first + plan.block_k - 1, plan.causal, plan.window, st.offset, self.q_len,
            st.q_length, st.kv_length,
        )  # fmt: skip
        return masking.tiles(lo - st.offset, hi - st.offset, plan.block_q)

    def span(self, index: int, block: int, length: int):
        pl, _ = _pallas()
        ids = index * block + jnp.arange(block, dtype=jnp.int32)
        return _ds(index * block, block), ids < length

    def rows(self, ref, b, span, n, width: int, live=None):
        """ref [B, L, N, D] rows span of batch row b and head n -> [block, padded D], cast to compute."""
        pl, plgpu = _pallas()
        index, ok = span
        padded = _pow2_tile(width)
        mask = ok[:, None] & (jnp.arange(padded, dtype=jnp.int32) < width)[None, :]
        x = plgpu.load(ref.at[b, index, n, _ds(0, padded)], mask=mask, other=0)
        x = x.astype(self.plan.compute_dtype)
        if live is not None:
            x = jnp.where(live[:, None] != 0, x, jnp.zeros((), x.dtype))
        return x

    def queries(self, q_ref, extras, b, n, q_span):
        """(q [bq, padded H] with dead queries zeroed, live_q or None) of one query block."""
        live_q = None if extras.live_q is None else self.vector(extras.live_q, b, n, q_span)
        return self.rows(q_ref, b, q_span, n, self.plan.head_dim, live_q), live_q

    def keys_values(self, k_ref, v_ref, extras, b, n, k_span):
        """(k, v of key/value head n // group with the keys query head n does not see zeroed,
        live_k or None) of one key block."""
        live_k = None if extras.live_k is None else self.vector(extras.live_k, b, n, k_span)
        kv = n // self.plan.group
        k = self.rows(k_ref, b, k_span, kv, self.plan.head_dim, live_k)
        v = self.rows(v_ref, b, k_span, kv, self.plan.value_dim, live_k)
        return k, v, live_k

    def store_rows(self, ref, b, span, n, width: int, x):
        pl, plgpu = _pallas()
        index, ok = span
        padded = _pow2_tile(width)
        mask = ok[:, None] & (jnp.arange(padded, dtype=jnp.int32) < width)[None, :]
        plgpu.store(ref.at[b, index, n, _ds(0, padded)], x.astype(ref.dtype), mask=mask)

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
        return plgpu.load(ref.at[bb, nn, q_index, k_index], mask=mask, other=other)

    def allowed(self, st: _Structure, q_span, k_span):
        """bool [bq, bk]: the causal, window and length masks of a tile (masking.allowed)."""
        plan = self.plan
        q_start, k_start = q_span[0].start, k_span[0].start
        qi = st.offset + q_start + jnp.arange(plan.block_q, dtype=jnp.int32)[:, None]
        kj = k_start + jnp.arange(plan.block_k, dtype=jnp.int32)[None, :]
        return masking.allowed(qi, kj, plan.causal, plan.window, st.q_length, st.kv_length)

    def logits(self, q, k, bias_refs, extras, st, b, n, q_span, k_span):
        """Scaled, biased, soft-capped, masked float32 logits [bq, bk] (keys past the end -inf),
        and the soft cap's derivative there (None: no cap)."""
        plan = self.plan
        s = _dot(q, k, trans_b=True, precision=plan.precision) * plan.scale
        for ref in bias_refs:
            s = s + self.tile(ref, b, n, q_span, k_span).astype(jnp.float32)
        cap_grad = None
        if plan.soft_cap is not None:
            t = jnp.tanh(s * (1.0 / plan.soft_cap))
            inside = q_span[1][:, None] & k_span[1][None, :]  # bias loads past the end give 0
            s, cap_grad = plan.soft_cap * t, jnp.where(inside, 1.0 - t * t, 0.0)
        if extras.mask is not None:
            keep = self.tile(extras.mask, b, n, q_span, k_span) != 0
            s = jnp.where(keep, s, numerics.MASK_VALUE)
        if st is not None:
            s = jnp.where(self.allowed(st, q_span, k_span), s, numerics.MASK_VALUE)
        return jnp.where(k_span[1][None, :], s, -jnp.inf), cap_grad


def _forward_kernel(q_ref, k_ref, v_ref, *refs, tiles: _Tiles):
    pl, plgpu = _pallas()
    plan = tiles.plan
    bias_refs, extras, (o_ref, lse_ref) = tiles.split(refs)
    b, n, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q_span = tiles.span(i, plan.block_q, tiles.q_len)
    q, _ = tiles.queries(q_ref, extras, b, n, q_span)
    st = tiles.structure(extras, b)

    def body(j, carry):
        acc, m_prev, l_prev = carry
        k_span = tiles.span(j, plan.block_k, tiles.k_len)
        k, v, _ = tiles.keys_values(k_ref, v_ref, extras, b, n, k_span)
        s, _ = tiles.logits(q, k, bias_refs, extras, st, b, n, q_span, k_span)
        m = jnp.maximum(m_prev, jnp.max(s, axis=1))
        correction = jnp.exp(m_prev - m)
        p = jnp.exp(s - m[:, None])
        acc = acc * correction[:, None] + _dot(p.astype(v.dtype), v, precision=plan.precision)
        return acc, m, l_prev * correction + jnp.sum(p, axis=1)

    init = (
        jnp.zeros((plan.block_q, _pow2_tile(plan.value_dim)), jnp.float32),
        jnp.full((plan.block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((plan.block_q,), jnp.float32),
    )
    acc, m, total = lax.fori_loop(*tiles.key_blocks(st, i), body, init)
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
    p = jnp.where(q_span[1][:, None], jnp.exp(s - lse[:, None]), 0.0)
    dp = _dot(do, v, trans_b=True, precision=plan.precision)
    ds = p * (dp - delta[:, None])
    return p, ds if cap_grad is None else ds * cap_grad


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, tiles: _Tiles):
    """dk, dv of one key block of key/value head `kv`, summed over its group's query heads."""
    pl, _ = _pallas()
    plan = tiles.plan
    bias_refs, extras, (dk_ref, dv_ref) = tiles.split(refs)
    b, kv, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    k_span = tiles.span(j, plan.block_k, tiles.k_len)
    st = tiles.structure(extras, b)
    dk = jnp.zeros((plan.block_k, _pow2_tile(plan.head_dim)), jnp.float32)
    dv = jnp.zeros((plan.block_k, _pow2_tile(plan.value_dim)), jnp.float32)
    seen = None  # keys some query head of the group sees
    for g in range(plan.group):
        n = kv * plan.group + g
        k, v, live_k = tiles.keys_values(k_ref, v_ref, extras, b, n, k_span)
        if live_k is not None:
            seen = live_k if seen is None else jnp.maximum(seen, live_k)

        def body(i, carry, n=n, k=k, v=v):
            dk, dv = carry
            q_span = tiles.span(i, plan.block_q, tiles.q_len)
            q, _ = tiles.queries(q_ref, extras, b, n, q_span)
            do = tiles.rows(do_ref, b, q_span, n, plan.value_dim)
            lse = tiles.vector(lse_ref, b, n, q_span)
            delta = tiles.vector(delta_ref, b, n, q_span)
            p, ds = _grads(tiles, q, k, v, do, lse, delta, bias_refs, extras, st, b, n, q_span,
                           k_span)  # fmt: skip
            dv = dv + _dot(p.astype(do.dtype), do, trans_a=True, precision=plan.precision)
            dk = dk + _dot(ds.astype(q.dtype), q, trans_a=True, precision=plan.precision)
            return dk, dv

        dk, dv = lax.fori_loop(*tiles.query_blocks(st, j), body, (dk, dv))
    dk = dk * plan.scale
    if seen is not None:  # keys no query sees were zeroed: no gradient reaches them
        dk, dv = (jnp.where(seen[:, None] != 0, x, 0.0) for x in (dk, dv))
    tiles.store_rows(dk_ref, b, k_span, kv, plan.head_dim, dk)
    tiles.store_rows(dv_ref, b, k_span, kv, plan.value_dim, dv)


def _dq_dbias_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, tiles: _Tiles, shapes: tuple
):
    """dq of one query block of every row of a group; the bias gradients it owns (module doc)."""
    pl, plgpu = _pallas()
    plan = tiles.plan
    bias_refs, extras, rest = tiles.split(refs)
    rest = rest[len(shapes) :]  # the zero-filled buffers aliased to the outputs below
    dq_ref, dbias_refs = rest[0], rest[1:]
    g, n, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    batch = q_ref.shape[0]
    q_span = tiles.span(i, plan.block_q, tiles.q_len)

    def accumulate(ref, shape, b, k_span, ds):
        """Adds ds, reduced to the bias's broadcast dims, into this program's tile of ref."""
        slot = b if shape[0] > 1 else g
        (q_index, q_ok), (k_index, k_ok) = q_span, k_span
        mask = None
        if shape[2] > 1:
            mask = q_ok[:, None]
        else:  # one partial row per query block
            ds, q_index = jnp.sum(ds, axis=0, keepdims=True), _ds(i, 1)
        if shape[3] > 1:
            mask = k_ok[None, :] if mask is None else mask & k_ok[None, :]
        else:
            ds, k_index = jnp.sum(ds, axis=1, keepdims=True), _ds(0, 1)
        view = ref.at[slot, n, q_index, k_index]
        plgpu.store(view, plgpu.load(view, mask=mask, other=0.0) + ds, mask=mask)

    def row(r, carry):
        b = g + plan.groups * r
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
                accumulate(ref, shape, b, k_span, ds)
            return dq + _dot(ds.astype(k.dtype), k, precision=plan.precision)

        init = jnp.zeros((plan.block_q, _pow2_tile(plan.head_dim)), jnp.float32)
        # Skipped key blocks leave the zero-filled bias-gradient buffers as they are.
        dq = lax.fori_loop(*tiles.key_blocks(st, i), body, init) * plan.scale
        if live_q is not None:
            dq = jnp.where(live_q[:, None] != 0, dq, 0.0)
        tiles.store_rows(dq_ref, b, q_span, n, plan.head_dim, dq)
        return carry

    rows = (batch - g + plan.groups - 1) // plan.groups  # rows g, g + groups, ... < batch
    lax.fori_loop(0, rows, row, 0)


def _forward(plan: _Plan, q, k, v, biases, extras):
    batch, q_len, heads, _ = q.shape
    tiles = _Tiles(plan, q_len, k.shape[1], len(biases))
    grid = (
        batch,
        heads,
        -(-q_len // plan.block_q),
    )  # batch rows vary fastest: bias tiles stay in L2
    out_shape = (
        jax.ShapeDtypeStruct((*q.shape[:3], v.shape[-1]), q.dtype),
        jax.ShapeDtypeStruct((batch, heads, q_len), jnp.float32),
    )
    args = (q, k, v, *biases, *extras)
    kernel = functools.partial(_forward_kernel, tiles=tiles)
    return plan.call(kernel, grid, out_shape, args, "gated_attention_forward")


def _attention_bwd(plan, residuals, cotangents):
    q, k, v, biases, extras, out, lse = residuals
    d_out, d_lse = cotangents
    batch, q_len, heads, _ = q.shape
    k_len = k.shape[1]
    tiles = _Tiles(plan, q_len, k_len, len(biases))
    delta = jnp.einsum(
        "btnh,btnh->bnt", out.astype(jnp.float32), d_out.astype(jnp.float32)
    )  # [B, N, T]: rowsum(dO * O), the softmax backward's correction
    delta = delta - d_lse.astype(jnp.float32)  # d lse / d logits = p: ds = p * (dp - delta + d_lse)
    common = (q, k, v, d_out, lse, delta, *biases, *extras)

    dk, dv = plan.call(
        functools.partial(_dkdv_kernel, tiles=tiles),
        (batch, plan.kv_heads, -(-k_len // plan.block_k)),
        (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
        common,
        "gated_attention_dkdv",
    )

    # Bias-gradient buffers [slots, N, T or query blocks, S or 1], float32, zero-filled.
    q_blocks = -(-q_len // plan.block_q)
    shapes = tuple(tuple(b.shape) for b in biases)
    buffers = tuple(
        jnp.zeros(
            (
                batch if s[0] > 1 else plan.groups,
                heads,
                q_len if s[2] > 1 else q_blocks,
                k_len if s[3] > 1 else 1,
            ),
            jnp.float32,
        )
        for s in shapes
    )
    first_buffer = len(common)
    dq, *partials = plan.call(
        functools.partial(_dq_dbias_kernel, tiles=tiles, shapes=shapes),
        (plan.groups, heads, q_blocks),
        (
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in buffers),
        ),
        (*common, *buffers),
        "gated_attention_dq_dbias",
        aliases={first_buffer + t: 1 + t for t in range(len(buffers))},
    )
    dbiases = []
    for bias, partial in zip(biases, partials, strict=True):
        axes = tuple(a for a in range(4) if bias.shape[a] == 1 and partial.shape[a] > 1)
        dbiases.append(jnp.sum(partial, axis=axes, keepdims=True).astype(bias.dtype))
    return dq, dk, dv, tuple(dbiases), tuple(None for _ in extras)


_attention = base.kernel_attention(_forward, _attention_bwd)
