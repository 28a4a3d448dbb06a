"""dot_product_attention speaks jax.nn.dot_product_attention's arguments (and tokamax's soft cap).

Scenarios modelled on JAX's nn tests (grouped-query attention, causal, local windows, sequence
lengths, the residual, T != S) and tokamax's attention tests (soft cap, biases and masks of lower
rank, several masks at once). Each scenario's expected values are jax.nn.dot_product_attention
(implementation='xla') on the float64 copies of the inputs, or, where jax.nn lacks the argument
(logits_soft_cap), the float64 reference (tests/reference.py) given the equivalent explicit mask:
the output, the residual (rows with a key to attend to) and the vjp (dq, dk, dv, dbias), for every
implementation that runs on CPU, in float32 and bfloat16.

Then what the arguments must not cost: no key or value repeated to the query heads, no
[B, N, T, S] or [B, 1, T, S] mask for the causal, window and length masks (read off the jaxprs),
and tile skipping in `chunked`; masked garbage does not leak through the new masks; sharded
queries; and what cudnn refuses.

Compile time is the cost (2 CPU cores): all scenarios of one (implementation, dtype) are one
jitted program, compiled once and fed other data where a test needs it.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jax_core
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gated_attention as ga
from gated_attention.attention.xla_chunked import kernels as chunked_tiles
from gated_attention.attention.xla_chunked import plan as chunked_plan
from gated_attention.core import masking
from tests import implementation_harness as harness
from tests import reference
from tests.helpers import as_f64, assert_close, device_param, jit_reference, rand

B, N, H = 2, 4, 8  # jax.nn needs the value head dim equal to H


class Scenario(NamedTuple):
    """One call: shapes, the bias and mask shapes (None: absent) and the keyword arguments."""

    kv_heads: int
    q_len: int
    kv_len: int
    bias: tuple[int, ...] | None
    mask: tuple[int, ...] | None
    kwargs: dict[str, Any]
    jax_nn: bool = True  # jax.nn takes every argument (else: the float64 reference)


def _lengths(*values):
    return np.array(values, np.int32)


SCENARIOS = {
    "gqa 4 over 1, causal, T > S, [T, S] bias": Scenario(
        1, 7, 5, (7, 5), None, dict(is_causal=True)
    ),
    "gqa 4 over 2, causal, key mask": Scenario(2, 6, 6, None, (B, 1, 1, 6), dict(is_causal=True)),
    "window (2, 1), [N, T, S] mask": Scenario(
        N, 6, 7, None, (N, 6, 7), dict(local_window_size=(2, 1))
    ),
    "gqa 4 over 2, window 1, causal, lengths": Scenario(
        2,
        6,
        6,
        (B, N, 6, 6),
        None,
        dict(
            local_window_size=1,
            is_causal=True,
            query_seq_lengths=_lengths(4, 6),
            key_value_seq_lengths=_lengths(6, 0),  # batch row 1: no key at all
        ),
    ),
    "mqa 4 over 1, lengths, T != S, [N, 1, S] bias, [T, S] mask": Scenario(
        1,
        5,
        7,
        (N, 1, 7),
        (5, 7),
        dict(query_seq_lengths=_lengths(3, 5), key_value_seq_lengths=_lengths(7, 2)),
    ),
    "soft cap, gqa 4 over 2, causal": Scenario(
        2, 6, 6, (N, 6, 6), None, dict(is_causal=True, logits_soft_cap=1.5), jax_nn=False
    ),
    "everything": Scenario(
        2,
        7,
        9,
        (1, N, 7, 9),
        (B, 1, 7, 9),
        dict(
            is_causal=True,
            local_window_size=(3, 0),
            query_seq_lengths=_lengths(5, 7),
            key_value_seq_lengths=_lengths(8, 4),
            logits_soft_cap=2.0,
        ),
        jax_nn=False,
    ),
}
NAMES = tuple(SCENARIOS)
LENGTHS = ("query_seq_lengths", "key_value_seq_lengths")

# Tiles of 2 x 3 and a block per batch row: tiles the structured masks hide are skipped, those
# they keep whole run unmasked, the rest masked.
CHUNKED = ga.ChunkedAttention(query_chunk_size=2, key_chunk_size=3, block_bytes=1)
IMPLEMENTATIONS = {
    "xla": ga.XlaAttention(tile_bytes=1),  # tiles of one batch row
    "chunked": CHUNKED,
    "auto": "auto",
    "cudnn adapter": ga.CudnnAttention(jax_nn_implementation="xla"),  # takes no soft cap
    "pallas_tpu": ga.PallasTpuAttention(interpret=True),  # the TPU kernels, interpreted
    "pallas": ga.PallasAttention(block_q=16, block_k=16, interpret=True),  # the GPU kernels
    "pallas fused": ga.PallasAttention(  # the one-pass backward
        block_q=16, block_k=16, fused_backward=True, interpret=True
    ),
    "mosaic": ga.MosaicAttention(interpret=True),  # the Hopper kernels, interpreted
    # Compiled and run on a device (`pytest -m device`): the kernels with their own tiles, cuDNN.
    "pallas compiled": ga.PallasAttention(),
    "pallas fused compiled": ga.PallasAttention(fused_backward=True),
    "mosaic compiled": ga.MosaicAttention(),
    "cudnn": ga.CudnnAttention(),
    "pallas_tpu compiled": ga.PallasTpuAttention(),
}
# bfloat16, 'auto' (on CPU: XlaAttention() at these sizes) and the cudnn adapter run the scenarios
# with the most arguments at once (compile time: each program costs ~10-30 s on 2 busy cores).
CORE = (
    "gqa 4 over 2, causal, key mask",
    "gqa 4 over 2, window 1, causal, lengths",
    "everything",
)
RUNS = [
    ("xla", "float32", NAMES),
    ("chunked", "float32", NAMES),
    ("auto", "bfloat16", CORE),
    ("chunked", "bfloat16", CORE),
    ("cudnn adapter", "float32", tuple(n for n in CORE if SCENARIOS[n].jax_nn)),
    # The kernels interpreted: ~10 s of compile per scenario (every kernel unrolls its 4 heads);
    # "everything" has the third CORE scenario's arguments (GQA, causal, a key mask) and more.
    ("pallas_tpu", "float32", CORE[1:]),
    ("pallas", "float32", CORE[1:]),
    ("pallas fused", "float32", CORE[1:]),
    ("mosaic", "float32", CORE[1:]),
]
# cuDNN takes jax.nn's arguments but a window right of the query without causal (its check says so).
# With a bias it needs even lengths (its backward refuses odd ones; CudnnAttention.check says so).
CUDNN = tuple(
    n
    for n, sc in SCENARIOS.items()
    if sc.jax_nn
    and not n.startswith("window (2, 1)")
    and not (sc.bias is not None and (sc.q_len % 2 or sc.kv_len % 2))
)
# On a device: every scenario in each dtype the compiled kernels take (cuDNN: jax.nn's arguments).
DEVICE_RUNS = [
    ("gpu", "pallas compiled", "float32", NAMES),
    ("gpu", "pallas compiled", "bfloat16", NAMES),
    ("gpu", "pallas fused compiled", "bfloat16", NAMES),
    ("gpu", "mosaic compiled", "float32", NAMES),  # the device machines are Hopper GPUs
    ("gpu", "mosaic compiled", "bfloat16", NAMES),
    ("gpu", "cudnn", "bfloat16", CUDNN),
    ("tpu", "pallas_tpu compiled", "float32", NAMES),
    ("tpu", "pallas_tpu compiled", "bfloat16", NAMES),
]
# Their float32 runs (of every scenario) also check masked garbage beyond the lengths.
GARBAGE_RUNS = (
    "xla", "chunked", "pallas_tpu", "pallas", "pallas fused", "mosaic", "pallas compiled",
    "mosaic compiled", "pallas_tpu compiled",
)  # fmt: skip


class Case(NamedTuple):
    q: Any
    k: Any
    v: Any
    bias: Any
    mask: Any
    cot: Any


def case(name: str, dtype: str, seed: int = 0) -> tuple[Case, Case]:
    """A scenario's inputs in dtype and their float64 copies (the mask as NumPy in the copy)."""
    sc = SCENARIOS[name]
    rng = np.random.default_rng(seed)
    q, q64 = rand(rng, (B, sc.q_len, N, H), dtype)
    k, k64 = rand(rng, (B, sc.kv_len, sc.kv_heads, H), dtype)
    v, v64 = rand(rng, (B, sc.kv_len, sc.kv_heads, H), dtype)
    cot, cot64 = rand(rng, (B, sc.q_len, N, H), dtype)
    bias = bias64 = mask = None
    if sc.bias is not None:
        bias, bias64 = rand(rng, sc.bias, dtype)
    if sc.mask is not None:
        mask = rng.random(sc.mask) > 0.25
    mask_j = None if mask is None else jnp.asarray(mask)
    return Case(q, k, v, bias, mask_j, cot), Case(q64, k64, v64, bias64, mask, cot64)


def allowed(name: str) -> np.ndarray:
    """bool [B, 1|N, T, S]: the scenario's mask with its causal, window and length masks."""
    sc = SCENARIOS[name]
    kw = sc.kwargs
    i, j = np.arange(sc.q_len)[:, None], np.arange(sc.kv_len)[None, :]
    ok = np.ones((B, 1, sc.q_len, sc.kv_len), bool)
    if kw.get("is_causal"):
        ok &= j <= i
    window = kw.get("local_window_size")
    if window is not None:
        left, right = (window, window) if isinstance(window, int) else window
        ok &= (j >= i - left) & (j <= i + right)
    if kw.get("query_seq_lengths") is not None:
        ok &= (i < kw["query_seq_lengths"][:, None, None])[:, None]
    if kw.get("key_value_seq_lengths") is not None:
        ok &= (j < kw["key_value_seq_lengths"][:, None, None])[:, None]
    if sc.mask is not None:
        ok = ok & case(name, "float32")[1].mask
    return ok


def valid_queries(name: str) -> np.ndarray:
    """bool [B, T, 1, 1]: the queries within query_seq_lengths (the others output zero)."""
    sc = SCENARIOS[name]
    lengths = sc.kwargs.get("query_seq_lengths")
    if lengths is None:
        return np.ones((B, sc.q_len, 1, 1), bool)
    return (np.arange(sc.q_len)[None] < lengths[:, None])[..., None, None]


def _ours(impl, name: str):
    def attend(q, k, v, bias, mask):  # -> (out, residual)
        return ga.dot_product_attention(
            q,
            k,
            v,
            bias,
            mask,
            implementation=impl,
            compute_dtype="input",
            return_residual=True,
            **SCENARIOS[name].kwargs,
        )

    return attend


def _jax_nn(name: str):
    kwargs = {k: (jnp.asarray(v) if k in LENGTHS else v) for k, v in SCENARIOS[name].kwargs.items()}

    def attend(q, k, v, bias, mask):
        return jax.nn.dot_product_attention(
            q, k, v, bias, mask, implementation="xla", return_residual=True, **kwargs
        )

    return attend


def _reference(name: str):
    mask, valid = jnp.asarray(allowed(name)), jnp.asarray(valid_queries(name))
    cap = SCENARIOS[name].kwargs.get("logits_soft_cap")

    def attend(q, k, v, bias, _):
        out = reference.dot_product_attention(q, k, v, bias, mask, soft_cap=cap, xp=jnp)
        return jnp.where(valid, out, 0.0), None

    return attend


def _program(attends, jit=jax.jit):
    """jit of: every case's (out, residual, vjp at its cotangent)."""

    def run(cases):
        results = []
        for attend, c in zip(attends, cases, strict=True):
            fn = lambda q, k, v, bias, attend=attend, mask=c.mask: attend(q, k, v, bias, mask)
            out, vjp, residual = jax.vjp(fn, c.q, c.k, c.v, c.bias, has_aux=True)
            results.append((out, residual, vjp(c.cot)))
        return results

    return jit(run)


@functools.cache
def program(impl_name: str, names: tuple[str, ...]):
    return _program([_ours(IMPLEMENTATIONS[impl_name], n) for n in names])


@functools.cache
def _expected_program():
    """float64, every scenario: jax.nn where it takes the scenario, else the reference."""
    attends = [(_jax_nn if SCENARIOS[n].jax_nn else _reference)(n) for n in NAMES]
    return _program(attends, jit=jit_reference)


def expected(names: tuple[str, ...], cases64: list[Case]) -> list:
    """The float64 expected results of `names`' float64 cases: one program for every subset (the
    scenarios not asked for are fed their float32 inputs' copies, and dropped)."""
    given = dict(zip(names, cases64, strict=True))
    full = [given[n] if n in given else case(n, "float32")[1] for n in NAMES]
    results = _expected_program()(full)
    return [results[NAMES.index(n)] for n in names]


def _failures(names, results, expected, dtype, cases) -> list[str]:
    """Every mismatch (not only the first), as messages."""
    failures = []
    tol = reference.tolerance(dtype)
    for name, (out, res, grads), (e_out, e_res, e_grads), c in zip(
        names, results, expected, cases, strict=True
    ):
        try:
            assert out.dtype == c.q.dtype and res.dtype == jnp.float32, "dtypes"
            assert res.shape == out.shape[:-1], f"residual shape {res.shape}"
            assert_close(out, as_f64(e_out), tol, err_msg="output")
            has_key = np.swapaxes(allowed(name).any(axis=-1), 1, 2)  # [B, T, 1|N]
            has_key = np.broadcast_to(has_key, res.shape)
            res = as_f64(res)
            if e_res is not None:
                assert_close(res[has_key], as_f64(e_res)[has_key], tol, err_msg="residual")
            dead = res[~has_key]  # rows with no key: MASK_VALUE + log(S), finite
            assert_close(dead, np.full(dead.shape, -1e9 + math.log(SCENARIOS[name].kv_len)), tol)
            for label, g, e in zip(("dq", "dk", "dv", "dbias"), grads, e_grads, strict=True):
                assert (g is None) == (e is None), label
                if g is not None:
                    assert g.shape == e.shape and g.dtype == c.q.dtype, label
                    e = as_f64(e)
                    assert_close(g, e, reference.grad_tolerance(dtype, e), err_msg=label)
        except AssertionError as error:
            failures.append(f"{name}: {error}")
    return failures


@pytest.mark.parametrize(
    ("impl_name", "dtype", "names"),
    [pytest.param(*run, id=f"{run[0]}-{run[1]}") for run in RUNS]
    + [device_param(*run, kind=kind, id=f"{run[0]}-{run[1]}") for kind, *run in DEVICE_RUNS],
)
def test_matches_jax_nn_or_the_reference(impl_name, dtype, names):
    """Every scenario of `names` against jax.nn or the reference; for 'xla' and 'chunked' in
    float32 also masked garbage beyond the lengths (garbage_failures), fed to the same compiled
    program (one test: pytest-xdist's workers would each compile it)."""
    pairs = [case(n, dtype) for n in names]
    run = program(impl_name, names)
    results = run([p[0] for p in pairs])
    want = expected(names, [p[1] for p in pairs])
    failures = _failures(names, results, want, dtype, [p[0] for p in pairs])
    if impl_name in GARBAGE_RUNS and dtype == "float32":
        failures += garbage_failures(run, names, [p[0] for p in pairs])
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------------------------------------
# Masked garbage does not leak through the length masks
# ------------------------------------------------------------------------------------------------


def _with_garbage(name: str, c: Case) -> Case:
    """NaN in the queries beyond query_seq_lengths, NaN and inf in the keys and values beyond
    key_value_seq_lengths."""
    kw = SCENARIOS[name].kwargs
    q, k, v = (np.array(x) for x in (c.q, c.k, c.v))
    for b in range(B):
        q[b, kw["query_seq_lengths"][b] :] = np.nan
        k[b, kw["key_value_seq_lengths"][b] :] = np.nan
        v[b, kw["key_value_seq_lengths"][b] :] = np.inf
    return c._replace(q=jnp.asarray(q), k=jnp.asarray(k), v=jnp.asarray(v))


def garbage_failures(run, program_names, clean: list[Case]) -> list[str]:
    """Garbage beyond the lengths: rows with a key and every gradient are the clean run's (and
    finite), the queries beyond the length output zero. (A batch row with no key at all gives
    the uniform average of the values as given, garbage included: numerics.py.)

    run: the float32 program of the scenarios program_names; clean: their float32 cases.
    Returns the failures' messages."""
    names = [n for n in program_names if "query_seq_lengths" in SCENARIOS[n].kwargs]
    assert len(names) >= 2
    dirty = [
        _with_garbage(n, c) if n in names else c for n, c in zip(program_names, clean, strict=True)
    ]
    failures = []
    for name, (out, _, grads), (clean_out, _, clean_grads) in zip(
        program_names, run(dirty), run(clean), strict=True
    ):
        if name not in names:
            continue
        try:
            has_key = allowed(name).any(axis=-1).swapaxes(1, 2)[..., None]  # [B, T, 1|N, 1]
            has_key = np.broadcast_to(has_key, out.shape)
            out, clean_out = np.asarray(out), np.asarray(clean_out)
            tight = dict(rtol=1e-6, atol=1e-6)
            assert_close(out[has_key], clean_out[has_key], tight, err_msg=name)
            beyond = ~np.broadcast_to(valid_queries(name), out.shape)
            np.testing.assert_array_equal(out[beyond], 0.0, err_msg=name)
            for g, clean_g in zip(grads, clean_grads, strict=True):
                assert np.isfinite(np.asarray(g)).all(), name
                assert_close(g, np.asarray(clean_g), tight, err_msg=name)
        except AssertionError as error:
            failures.append(f"garbage beyond the lengths, {name}: {error}")
    return failures


# ------------------------------------------------------------------------------------------------
# What the arguments must not cost, read off the jaxprs
# ------------------------------------------------------------------------------------------------


def _shapes(jaxpr) -> set[tuple[int, ...]]:
    """The shape of every value an equation makes, in jaxpr and every jaxpr inside it."""
    shapes = set()
    for eqn in jaxpr.eqns:
        shapes.update(tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
        todo = list(eqn.params.values())
        while todo:
            p = todo.pop()
            if isinstance(p, jax_core.ClosedJaxpr):
                shapes |= _shapes(p.jaxpr)
            elif isinstance(p, jax_core.Jaxpr):
                shapes |= _shapes(p)
            elif isinstance(p, (tuple, list)):
                todo.extend(p)
    return shapes


def _forward_and_grad_shapes(fn, *args) -> set[tuple[int, ...]]:
    loss = lambda *a: jnp.sum(fn(*a) ** 2)
    grad = jax.grad(loss, argnums=tuple(range(len(args))))
    return _shapes(jax.make_jaxpr(fn)(*args).jaxpr) | _shapes(jax.make_jaxpr(grad)(*args).jaxpr)


def test_gqa_never_repeats_keys_or_values():
    """8 query heads over 1 key/value head: no [B, S, 8, H] or [B, 8, S, H] array (S padded or
    not), forward or backward, in 'xla' and 'chunked' (a version that repeats is caught)."""
    b, t, s, n, h = 2, 5, 7, 8, 4  # chunked pads S = 7 to 9
    q = jnp.ones((b, t, n, h))
    kv = jnp.ones((b, s, 1, h))
    bias, mask = jnp.ones((n, t, s)), jnp.ones((b, 1, 1, s), bool)

    def repeated(shapes):
        return sorted(x for x in shapes if x and x[-1] == h and n in x[:-1] and ({s, 9} & set(x)))

    def op(impl):
        return lambda q, k, v: ga.dot_product_attention(
            q, k, v, bias, mask, is_causal=True, implementation=impl
        )

    def repeat_first(q, k, v):  # what must be caught
        k, v = (jnp.repeat(x, n, axis=2) for x in (k, v))
        return ga.dot_product_attention(q, k, v, bias, mask, implementation="xla")

    assert repeated(_forward_and_grad_shapes(repeat_first, q, kv, kv))
    for impl in (ga.XlaAttention(tile_bytes=1), CHUNKED):
        assert not repeated(_forward_and_grad_shapes(op(impl), q, kv, kv)), impl.name


def test_causal_window_and_lengths_build_no_full_mask():
    """No array of the size of a [B, 1, T, S] mask with trailing [T, S] dimensions, forward or
    backward: 'xla' builds the masks per tile of one batch row; 'chunked' per query x key tile
    (no [.., T, S] array at all). jax.nn.dot_product_attention, which does, is caught."""
    b, t, n, h = 4, 32, 2, 4
    q = jnp.ones((b, t, n, h))
    lengths = jnp.array([32, 20, 7, 0], jnp.int32)
    kwargs = dict(
        is_causal=True,
        local_window_size=(9, 0),
        query_seq_lengths=lengths,
        key_value_seq_lengths=lengths[::-1],
    )

    def full_masks(shapes):
        return sorted(x for x in shapes if x[-2:] == (t, t) and math.prod(x) >= b * t * t)

    assert full_masks(
        _forward_and_grad_shapes(functools.partial(jax.nn.dot_product_attention, **kwargs), q, q, q)
    )
    xla = ga.XlaAttention(tile_bytes=1)
    tiles = ga.ChunkedAttention(query_chunk_size=8, key_chunk_size=8, block_bytes=1)
    for impl in (xla, tiles):
        fn = lambda q, k, v, impl=impl: ga.dot_product_attention(
            q, k, v, implementation=impl, **kwargs
        )
        shapes = _forward_and_grad_shapes(fn, q, q, q)
        assert not full_masks(shapes), impl.name
        if impl is tiles:
            assert not [x for x in shapes if x[-2:] == (t, t)]


def _runs(runs_of, count, *args):
    """[(first, full_lo, full_hi, stop)] of each tile, as ints."""
    return [tuple(int(x) for x in runs_of(i, *args)) for i in range(count)]


def test_chunked_skips_the_tiles_the_structure_masks():
    """Causal, T = S = 8 in 2 x 2 tiles: query tile i meets key tiles 0..i, of which 0..i-1
    whole (no mask built) and i in part; key tile j is met by query tiles j..3: forward and
    backward do 10 of 16 tiles. A window and key lengths cut more."""
    t = chunked_plan.Tiling(1.0, 2, 2, 8, 8, 1, jnp.float32)
    causal = masking.StructuredMask(is_causal=True)
    assert _runs(lambda i: chunked_tiles._key_runs(causal, i, t), 4) == [
        (0, 0, 0, 1),
        (0, 0, 1, 2),
        (0, 0, 2, 3),
        (0, 0, 3, 4),
    ]
    assert _runs(lambda j: chunked_tiles._query_runs(causal, j, t), 4) == [
        (0, 1, 4, 4),
        (1, 2, 4, 4),
        (2, 3, 4, 4),
        (3, 4, 4, 4),
    ]
    window = masking.StructuredMask(is_causal=True, window=(2, 0), kv_lengths=jnp.array([5, 3]))
    # Query tile 3 (rows 6, 7) reaches keys 4..7, but no row has a key beyond 4: tile 2 only,
    # in part (row 1 has no key beyond 2).
    assert _runs(lambda i: chunked_tiles._key_runs(window, i, t), 4) == [
        (0, 0, 0, 1),
        (0, 1, 1, 2),
        (1, 3, 3, 3),
        (2, 3, 3, 3),
    ]


# ------------------------------------------------------------------------------------------------
# Shapes, sharded queries, refusals
# ------------------------------------------------------------------------------------------------


def test_batch_dims_lengths_and_residual_shapes():
    """Lengths take the query's batch dims ((1,) as well for unbatched inputs, as jax.nn); the
    residual is [..., T, N] in float32."""
    q = jax.ShapeDtypeStruct((2, 3, 5, 4, 8), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 3, 6, 2, 8), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((2, 3), jnp.int32)
    fn = functools.partial(ga.dot_product_attention, is_causal=True, return_residual=True)
    out, res = jax.eval_shape(
        lambda q, k, v, n: fn(q, k, v, query_seq_lengths=n, key_value_seq_lengths=n),
        q,
        kv,
        kv,
        lengths,
    )
    assert (out.shape, out.dtype, res.shape, res.dtype) == (
        (2, 3, 5, 4, 8),
        jnp.bfloat16,
        (2, 3, 5, 4),
        jnp.float32,
    )
    unbatched = jax.ShapeDtypeStruct((5, 4, 8), jnp.float32)
    out, res = jax.eval_shape(
        lambda q, n: fn(q, q, q, query_seq_lengths=n),
        unbatched,
        jax.ShapeDtypeStruct((1,), jnp.int32),
    )
    assert out.shape == (5, 4, 8) and res.shape == (5, 4)


def test_queries_sharded_along_t_keep_their_positions():
    """Batch rows over 'data', query positions over 'model' (each device's queries start at its
    own offset): causal, window and lengths as jax.nn, for 'chunked', 'xla' and the TPU kernel
    (interpreted)."""
    mesh = jax.make_mesh((4, 2), ("data", "model"), devices=jax.devices()[:8])
    rng = np.random.default_rng(3)
    b, t, n, k, h = 4, 8, 4, 2, 4
    q, q64 = rand(rng, (b, t, n, h), "float32")
    kv, kv64 = rand(rng, (b, t, k, h), "float32")
    lengths = _lengths(8, 5, 3, 0)
    kwargs = dict(is_causal=True, local_window_size=(2, 0), return_residual=True)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    expected, expected_res = jit_reference(  # one program, not an op-by-op dispatch
        lambda q, kv, n, m: jax.nn.dot_product_attention(
            q, kv, kv, query_seq_lengths=n, key_value_seq_lengths=m, **kwargs
        )
    )(q64, kv64, lengths, lengths[::-1].copy())
    impls = (
        ga.ChunkedAttention(query_chunk_size=2, key_chunk_size=2),
        "xla",
        ga.PallasTpuAttention(interpret=True),
    )
    for impl in impls:
        out, res = jax.jit(
            lambda q, k, n, m, impl=impl: ga.dot_product_attention(
                q, k, k, implementation=impl, query_seq_lengths=n, key_value_seq_lengths=m, **kwargs
            )
        )(
            put(q, P("data", "model")),
            put(kv, P("data")),
            put(lengths, P("data")),
            put(lengths[::-1].copy(), P("data")),
        )
        assert tuple(out.sharding.spec)[:2] == ("data", "model")
        assert_close(out, np.asarray(expected), reference.tolerance("float32"))
        live = np.asarray(expected_res) > -1e30
        assert_close(
            np.asarray(res)[live], np.asarray(expected_res)[live], reference.tolerance("float32")
        )


def _spec(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def _options(**kwargs):
    structure = {
        k: kwargs.pop(k) for k in ("is_causal", "window", "q_lengths", "kv_lengths") if k in kwargs
    }
    return ga.attention.base.Options(masking.StructuredMask(**structure), **kwargs)


REFUSALS = {
    "grouped": (2, {}, r"grouped-query attention \(4 over 2 heads\)"),
    "causal": (4, dict(is_causal=True), "is_causal"),
    "window": (4, dict(window=(1, 1)), "local_window_size"),
    "lengths": (4, dict(q_lengths=_spec((2,), jnp.int32)), "query_seq_lengths"),
    "soft cap": (4, dict(logits_soft_cap=2.0), "logits_soft_cap"),
    "precision": (4, dict(precision=jax.lax.Precision.HIGHEST), "precision"),
    "residual": (4, dict(return_residual=True), "return_residual"),
}


@pytest.mark.parametrize("option", sorted(REFUSALS))
@pytest.mark.parametrize(
    "impl",
    [
        ga.PallasAttention(interpret=True),
        ga.MosaicAttention(interpret=True),
        ga.PallasTpuAttention(interpret=True),
    ],
)
def test_the_kernels_take_every_option(impl, option):
    """The GPU and TPU kernels implement every option (tested against jax.nn above and in
    tests/test_pallas*.py); check takes each."""
    kv_heads, kwargs, _ = REFUSALS[option]
    q, kv = _spec((2, 16, 4, 16)), _spec((2, 16, kv_heads, 16))
    impl.check(q, kv, kv, (), None, compute_dtype=jnp.bfloat16, options=_options(**kwargs))


def test_cudnn_takes_jax_nns_arguments_and_refuses_the_rest():
    q, kv = _spec((2, 16, 4, 16)), _spec((2, 16, 2, 16))
    cudnn = ga.CudnnAttention()
    check = functools.partial(cudnn.check, q, kv, kv, (), None, compute_dtype=jnp.bfloat16)
    for option in ("soft cap", "precision"):
        _, kwargs, match = REFUSALS[option]
        with pytest.raises(NotImplementedError, match="cudnn does not implement " + match):
            check(options=_options(**kwargs))
    with pytest.raises(NotImplementedError, match=r"right of the query unless causal.*\(1, 1\)"):
        check(options=_options(window=(1, 1)))
    taken = _options(
        is_causal=True, window=(3, 1), kv_lengths=_spec((2,), jnp.int32), return_residual=True
    )
    if jax.default_backend() != "gpu":
        with pytest.raises(NotImplementedError, match="GPU only"):  # got past the options
            check(options=taken)
    else:
        check(options=taken)


@pytest.mark.parametrize(
    "impl",
    [
        pytest.param(ga.PallasTpuAttention(interpret=True), id="pallas_tpu"),  # 3 x 3 tiles of 128
        pytest.param(ga.PallasAttention(block_q=64, block_k=64, interpret=True), id="pallas"),
        pytest.param(ga.MosaicAttention(block_k=64, interpret=True), id="mosaic"),
        device_param(ga.PallasTpuAttention(), kind="tpu", id="pallas_tpu compiled"),
        device_param(ga.PallasAttention(block_q=64, block_k=64), kind="gpu", id="pallas compiled"),
        device_param(ga.MosaicAttention(), kind="gpu", id="mosaic compiled"),
    ],
)
def test_kernels_grouped_structured_and_capped_over_several_tiles(impl):
    """Grouped-query attention (2 query heads over 1), causal + window + both lengths, soft cap,
    a shared bias and a key mask, over several tiles (some skipped whole, some partial), in the
    GPU and TPU kernels (interpreted): forward, residual and every gradient against the float64
    reference given the equivalent mask."""
    b, t, s, n, k, h = harness.WIDE
    rng = np.random.default_rng(11)
    q, q64 = rand(rng, (b, t, n, h), "float32")
    key, k64 = rand(rng, (b, s, k, h), "float32")
    v, v64 = rand(rng, (b, s, k, h), "float32")
    bias, bias64 = rand(rng, (1, n, t, s), "float32")
    cot, cot64 = rand(rng, (b, t, n, h), "float32")
    key_mask = rng.random((b, 1, 1, s)) > 0.1
    allowed = harness.allowed_by(t, s, harness.STRUCTURED) & key_mask
    valid = (np.arange(t)[None] < harness.STRUCTURED["query_seq_lengths"][:, None])[..., None, None]

    def ours(q, key, v, bias):
        return ga.dot_product_attention(
            q, key, v, bias, jnp.asarray(key_mask), implementation=impl,
            return_residual=True, **harness.STRUCTURED,
        )  # fmt: skip

    def expected(q, key, v, bias):
        out = reference.dot_product_attention(
            q, key, v, bias, jnp.asarray(allowed), soft_cap=3.0, xp=jnp
        )
        return jnp.where(jnp.asarray(valid), out, 0.0)

    @jax.jit  # one program each (eager, every op would compile alone)
    def run(q, key, v, bias, cot):
        out, vjp, res = jax.vjp(ours, q, key, v, bias, has_aux=True)
        return out, res, vjp(cot)

    @jit_reference
    def run_expected(q, key, v, bias, cot):
        want, vjp = jax.vjp(expected, q, key, v, bias)
        return want, vjp(cot)

    out, res, grads = run(q, key, v, bias, cot)
    want, want_grads = run_expected(q64, k64, v64, bias64, cot64)
    assert_close(out, want, reference.tolerance("float32"))
    has_key = np.swapaxes(allowed.any(axis=-1), 1, 2)  # [B, T, 1]
    assert has_key.sum() < has_key.size  # rows beyond the lengths have none
    logits = np.einsum("btnh,bsnh->bnts", q64, np.repeat(k64, n // k, axis=2)) / np.sqrt(h) + bias64
    logits = np.where(allowed, 3.0 * np.tanh(logits / 3.0), -np.inf)
    with np.errstate(divide="ignore"):
        lse = np.log(np.exp(logits).sum(-1)).transpose(0, 2, 1)  # [B, T, N]
    live = np.broadcast_to(has_key, lse.shape)
    assert_close(np.asarray(res)[live], lse[live], reference.tolerance("float32"))
    for name, g, e in zip(("dq", "dk", "dv", "dbias"), grads, want_grads, strict=True):
        e = np.asarray(e)
        assert_close(g, e, reference.grad_tolerance("float32", e), err_msg=name)
