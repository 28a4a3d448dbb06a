"""ChunkedAttention: the harness's tests, and what chunking adds (padding, the row-bound fallback,
vmap, automatic chunk sizes, the memory bound, argument checks).

Every distinct shape and setting costs an XLA compilation (~1-3 s for forward and backward on 2
cores), so the cases below share programs where they can (tests.implementation_harness.run).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gated_attention as ga
from gated_attention.attention.xla_chunked.plan import (
    DEFAULT_MEMORY_BUDGET_BYTES,
    choose_chunk_sizes,
)
from gated_attention.core.memory import chunked_tile_bytes as tile_bytes
from tests import reference
from tests.helpers import all_eqns, as_f64, assert_close, rand
from tests.implementation_harness import (
    SHAPE,
    Case,
    Checks,
    ImplementationTests,
    assert_matches,
    check_types,
    reference_run,
    run,
)

PADDED = ga.ChunkedAttention(query_chunk_size=2, key_chunk_size=3, block_bytes=1)


class TestChunkedAttention(ImplementationTests):
    """The defaults: one block, one tile at these sizes."""

    IMPL = ga.ChunkedAttention()


class TestChunkedAttentionPaddedTiles(ImplementationTests):
    """Blocks of one batch row, 2 x 3 tiles: T = 7 and S = 8 are padded to 8 and 9.

    float32 and bfloat16 take each branch of the precision code (input dtype equal to, and below,
    the accumulation dtype); TestChunkedAttention runs float16 and float64 through the same
    functions, and test_loose_row_bounds_and_large_logits float64 in several tiles (each dtype
    costs a compilation of ~6 s here).
    """

    IMPL = PADDED
    DTYPES = ("float32",)  # padding is dtype-independent; TestChunkedAttention covers every dtype


def test_tilings_of_the_test_classes_and_blocks():
    b, t, s, n, h, hv = SHAPE
    args = (b, n, t, s, h, hv, jnp.float32)
    assert ga.ChunkedAttention().tiling(*args) == (b, t, s)  # one block, one tile
    assert PADDED.tiling(*args) == (1, 2, 3)  # a block per row, padded tiles
    # Rows per block grow with block_bytes and divide the batch; chunks are clipped to T and S.
    tilings = [
        ga.ChunkedAttention(query_chunk_size=64, block_bytes=block).tiling(6, *args[1:])
        for block in (1, 10**4, 2 * 10**4, 10**9)
    ]
    rows = [r for r, _, _ in tilings]
    assert rows == sorted(rows) and rows[0] == 1 and rows[-1] == 6
    assert all(6 % r == 0 for r in rows) and any(1 < r < 6 for r in rows), rows
    assert all((tq, tk) == (t, s) for _, tq, tk in tilings)


def _case(shape, *, bias_shape, mask_shape, seed, dtype="float32"):
    """(case, float64 case): q [B, T, N, H] etc. for shape (B, T, S, N, H, Hv)."""
    b, t, s, n, h, hv = shape
    rng = np.random.default_rng(seed)
    q, q64 = rand(rng, (b, t, n, h), dtype)
    k, k64 = rand(rng, (b, s, n, h), dtype)
    v, v64 = rand(rng, (b, s, n, hv), dtype)
    cot, cot64 = rand(rng, (b, t, n, hv), dtype)
    bias = bias64 = mask = None
    if bias_shape is not None:
        bias, bias64 = rand(rng, bias_shape, dtype)
    if mask_shape is not None:
        mask = rng.random(mask_shape) > 0.3
    return (
        Case(q, k, v, bias, None if mask is None else jnp.asarray(mask), cot),
        Case(q64, k64, v64, bias64, mask, cot64),
    )


def _loose_tolerance(expected):
    """For logits of several hundred: their float32 rounding alone is ~1e-5 absolute."""
    scale = max(1.0, max(float(np.abs(x).max()) for x in jax.tree.leaves(expected)))
    return dict(rtol=2e-4, atol=2e-4 * scale)


def _assert_close_tree(result, expected, tol, name):
    for i, (x, r) in enumerate(
        zip(jax.tree.leaves(result), jax.tree.leaves(expected), strict=True)
    ):
        assert np.isfinite(np.asarray(as_f64(x))).all(), f"{name}: leaf {i} not finite"
        assert_close(x, r, tol, err_msg=f"{name}: leaf {i}")


# ------------------------------------------------------------------------------------------------
# Lengths, chunk sizes, row bounds, large logits (one program per test)
# ------------------------------------------------------------------------------------------------

# All at this (custom) logit scale.
SCALE = 0.3

# name -> (shape (B, T, S, N, H, Hv), implementation); a bias [1, N, T, S], a key mask [B, 1, 1, S].
LENGTHS = {
    "1x7-chunks4": ((2, 1, 7, 2, 4, 3), ga.ChunkedAttention(query_chunk_size=4, key_chunk_size=4)),
    "7x1-chunks4": ((2, 7, 1, 2, 4, 3), ga.ChunkedAttention(query_chunk_size=4, key_chunk_size=4)),
    "6x10-chunks1x3": (
        (2, 6, 10, 2, 4, 3),
        ga.ChunkedAttention(query_chunk_size=1, key_chunk_size=3),
    ),
    # A 16 KiB budget forces several tiles along both axes (checked in the test).
    "40x48-small-budget": (
        (2, 40, 48, 2, 4, 4),
        ga.ChunkedAttention(memory_budget_bytes=2**14),
    ),
}

LOOSE_SHAPE = (1, 20, 30, 2, 8, 8)  # B, T, S, N, H, Hv
LOOSE = ga.ChunkedAttention(query_chunk_size=8, key_chunk_size=16)


def _loose_bound_case(dtype, seed=3):
    """Inputs whose row bounds are far above the logits.

    The forward first shifts each row by an upper bound on its logits. Here: queries 0-7 are
    orthogonal to every key (|q| = |k| = 30, q.k = 0, bound 0.3 * 900 = 270), and row 9's bias has
    +500 on a masked key. exp(-270) underflows in float32, so those blocks must be recomputed with
    the running maximum (the float64 sums stay normal). Rows 10-15 are ordinary (their block takes
    the bounded path), row 16 is fully masked.
    """
    b, t, s, n, h, hv = LOOSE_SHAPE
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, t, n, h))
    k = 0.01 * rng.normal(size=(b, s, n, h))
    v = rng.normal(size=(b, s, n, hv))
    cot = rng.normal(size=(b, t, n, hv))
    bias = rng.normal(size=(1, n, t, s))
    mask = rng.random((1, 1, t, s)) > 0.3
    q[:, :8] = 0.0
    q[:, :8, :, 0] = 30.0
    k[..., 1] = 30.0
    mask[:, :, 9, 4] = False
    bias[:, :, 9, 4] = 500.0
    mask[:, :, 16] = False
    return _rounded(dtype, q, k, v, bias, mask, cot)


def _rounded(dtype, q, k, v, bias, mask, cot):
    """(case, float64 case) of float64 NumPy inputs rounded to dtype."""
    cast = [np.asarray(x).astype(jnp.dtype(dtype)) for x in (q, k, v, bias, cot)]
    q, k, v, bias, cot = (jnp.asarray(x) for x in cast)
    q64, k64, v64, bias64, cot64 = (x.astype(np.float64) for x in cast)
    return (
        Case(q, k, v, bias, None if mask is None else jnp.asarray(mask), cot),
        Case(q64, k64, v64, bias64, mask, cot64),
    )


def _large_logits_case():
    """Logits of several hundred (|q| ~ 200 |k|), no bias, no mask."""
    rng = np.random.default_rng(1)
    b, t, s, n, h, hv = LOOSE_SHAPE
    q = 200 * rng.normal(size=(b, t, n, h))
    k, v = rng.normal(size=(b, s, n, h)), rng.normal(size=(b, s, n, hv))
    cases = _rounded("float32", q, k, v, np.zeros(()), None, rng.normal(size=(b, t, n, hv)))
    return tuple(c._replace(bias=None, mask=None) for c in cases)


def _run_cases(named: dict, scale=SCALE):
    """name -> (case, result, reference result) for name -> ((case, float64 case), impl): one
    program for all of them."""
    pairs = [pair for pair, _ in named.values()]
    cases, cases64 = zip(*pairs, strict=True)
    results = run(tuple(impl for _, impl in named.values()), cases, scale=scale)
    expected = reference_run(cases64, scale=scale)
    return dict(zip(named, zip(cases, results, expected, strict=True), strict=True))


def test_lengths_and_chunk_sizes():
    named = {}
    for i, (name, (shape, impl)) in enumerate(LENGTHS.items()):
        b, t, s, n, _, _ = shape
        case = _case(shape, bias_shape=(1, n, t, s), mask_shape=(b, 1, 1, s), seed=i)
        named[name] = (case, impl)
    check = Checks()
    for name, (case, result, expected) in _run_cases(named).items():
        with check(name):
            check_types(result, case, name)
            assert_matches(result, expected, "float32", name)
    check.raise_failures()


def test_automatic_chunk_sizes_with_small_budget():
    shape, impl = LENGTHS["40x48-small-budget"]  # run by the test above
    b, t, s, n, h, hv = shape
    tq, tk = choose_chunk_sizes(b, n, t, s, h, hv, jnp.float32, 2**14)
    assert tq < t and tk < s
    assert impl.tiling(b, n, t, s, h, hv, jnp.float32)[1:] == (tq, tk)


def test_loose_row_bounds_and_large_logits():
    """Loose row bounds fall back to the running maximum (_loose_bound_case), in float32 and
    float64; logits of several hundred (no bias, no mask) are rescaled without overflow."""
    named = {
        f"loose {dtype}": (_loose_bound_case(dtype), LOOSE) for dtype in ("float32", "float64")
    }
    named["large logits"] = (_large_logits_case(), LOOSE)
    check = Checks()
    for name, (case, result, expected) in _run_cases(named).items():
        with check(name):
            check_types(result, case)
            float64 = case.q.dtype == jnp.float64
            tol = reference.tolerance("float64") if float64 else _loose_tolerance(expected)
            _assert_close_tree(result, expected, tol, name)
    check.raise_failures()


def test_vmap_matches_reference_and_keeps_the_fallback_a_cond():
    """One mapped element needs the fallback, the other does not: under vmap the fallback runs for
    both (the cond's predicate covers the mapped axis), the jaxpr keeps a cond (not a select
    computing both branches), and both elements match the reference, forward and backward."""
    b, t, s, n, _, _ = LOOSE_SHAPE
    loose, loose64 = _loose_bound_case("float32")
    plain, plain64 = _case(LOOSE_SHAPE, bias_shape=(1, n, t, s), mask_shape=(b, 1, t, s), seed=4)
    stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), loose, plain)

    def fwd_vjp(case):
        def attend(q, k, v, bias):
            return ga.dot_product_attention(
                q, k, v, bias, case.mask, scale=SCALE, implementation=LOOSE
            )

        out, vjp = jax.vjp(attend, case.q, case.k, case.v, case.bias)
        return out, vjp(case.cot)

    batched = jax.vmap(fwd_vjp)
    assert "cond[" in str(jax.make_jaxpr(batched)(stacked))
    result = jax.jit(batched)(stacked)
    for i, expected in enumerate(reference_run([loose64, plain64], scale=SCALE)):
        element = jax.tree.map(lambda x, i=i: x[i], result)
        _assert_close_tree(element, expected, _loose_tolerance(expected), f"element {i}")


# ------------------------------------------------------------------------------------------------
# Random shapes and chunks
# ------------------------------------------------------------------------------------------------


@settings(max_examples=3, deadline=None)
@given(
    dims=st.tuples(
        st.integers(1, 2),  # B
        st.integers(1, 12),  # T
        st.integers(1, 12),  # S
        st.integers(1, 3),  # N
        st.integers(1, 5),  # H
        st.integers(1, 5),  # Hv
    ),
    query_chunk=st.integers(1, 14),
    key_chunk=st.integers(1, 14),
    one_row_blocks=st.booleans(),
    bias_full=st.tuples(*[st.booleans()] * 4),
    mask_full=st.tuples(*[st.booleans()] * 4),
    seed=st.integers(0, 2**16),
)
def test_random_shapes_and_chunks(
    dims, query_chunk, key_chunk, one_row_blocks, bias_full, mask_full, seed
):
    b, t, s, n, _, _ = dims
    full = (b, n, t, s)
    bias_shape = tuple(d if f else 1 for d, f in zip(full, bias_full, strict=True))
    mask_shape = tuple(d if f else 1 for d, f in zip(full, mask_full, strict=True))
    case, case64 = _case(dims, bias_shape=bias_shape, mask_shape=mask_shape, seed=seed)
    impl = ga.ChunkedAttention(
        query_chunk_size=query_chunk,
        key_chunk_size=key_chunk,
        block_bytes=1 if one_row_blocks else 2**30,
    )
    result = run(impl, [case])[0]
    check_types(result, case)
    assert_matches(result, reference_run([case64])[0], "float32", f"{dims}")


# ------------------------------------------------------------------------------------------------
# Memory bound
# ------------------------------------------------------------------------------------------------


def _all_shapes(jaxpr):
    """Shapes of every equation output in a jaxpr, recursing into sub-jaxprs (loops, custom_vjp)."""
    return (tuple(getattr(v.aval, "shape", ())) for e in all_eqns(jaxpr) for v in e.outvars)


@pytest.mark.parametrize("with_bias", [False, True])
def test_forward_and_backward_hold_no_logits_sized_array(with_bias):
    """Tiles of 32 x 32 in blocks of one batch row (4 blocks): neither the forward nor the backward
    makes a [B, N, T, S] logits array, nor a head-major copy of the whole query, key or value."""
    b, length, n, h = 4, 256, 2, 16
    q = jnp.ones((b, length, n, h), jnp.float32)  # T = S = 256, H = Hv = 16
    mask = jnp.ones((b, 1, 1, length), bool)
    bias_shape = (1, n, length, length)
    bias = jnp.ones(bias_shape, jnp.float32) if with_bias else None
    impl = ga.ChunkedAttention(query_chunk_size=32, key_chunk_size=32, block_bytes=1)
    assert impl.tiling(b, n, length, length, h, h, jnp.float32) == (1, 32, 32)

    def fwd_bwd(q, k, v, bias):
        f = lambda q, k, v, bias: ga.dot_product_attention(  # noqa: E731
            q, k, v, bias, mask, implementation=impl
        )
        out, vjp = jax.vjp(f, q, k, v, bias)
        return out, vjp(out)

    shapes = set(_all_shapes(jax.make_jaxpr(fwd_bwd)(q, q, q, bias).jaxpr))
    sizes = {s: int(np.prod(s)) for s in shapes}
    # Only the bias and its gradient (the bias's own shape) may hold T * S elements.
    big = [s for s, size in sizes.items() if size >= length * length and s != bias_shape]
    assert not big, f"logits-sized arrays: {big}"
    assert any(s[-2:] == (32, 32) for s in shapes)  # the tiles are there
    # Arrays of the whole batch's q/k/v size stay in the public layout [..., T, N, H].
    whole = [s for s, size in sizes.items() if size == b * length * n * h]
    assert whole and all(s[-3:] == (length, n, h) for s in whole), whole


# ------------------------------------------------------------------------------------------------
# Chunk sizes and errors
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dims",
    [
        (1, 8, 4096, 4096, 32, 32),
        (64, 8, 256, 256, 8, 8),
        (1024, 4, 1024, 1024, 32, 32),
        (3, 2, 37, 29, 8, 5),
        (1, 1, 1, 1, 1, 1),
    ],
)
@pytest.mark.parametrize("budget", [2**12, 2**20, DEFAULT_MEMORY_BUDGET_BYTES, 2**34])
def test_choose_chunk_sizes_fits_budget(dims, budget):
    tq, tk = choose_chunk_sizes(*dims[:4], *dims[4:], jnp.float32, budget)
    _, _, q_len, kv_len, head_dim, value_dim = dims
    assert 1 <= tq <= q_len and 1 <= tk <= kv_len
    used = tile_bytes(dims[0], dims[1], tq, tk, head_dim, value_dim, jnp.float32)
    assert used <= budget or (tq, tk) == (1, 1)
    # A larger budget never gives a smaller tile.
    tq2, tk2 = choose_chunk_sizes(*dims[:4], *dims[4:], jnp.float32, budget * 4)
    assert tq2 * tk2 >= tq * tk


def test_choose_chunk_sizes_prefers_divisors_and_whole_small_problems():
    assert choose_chunk_sizes(2, 2, 37, 29, 8, 8, jnp.float32, 2**30) == (37, 29)
    tq, tk = choose_chunk_sizes(1, 8, 4096, 4096, 32, 32, jnp.float32, DEFAULT_MEMORY_BUDGET_BYTES)
    assert 4096 % tq == 0 and 4096 % tk == 0
    assert choose_chunk_sizes(1024, 4, 1024, 1024, 32, 32, jnp.float32, 1) == (1, 1)


@pytest.mark.parametrize("bad", [0, -4, 2.5, True, "8"])
def test_bad_chunk_sizes_raise(bad):
    for name in ("query_chunk_size", "key_chunk_size"):
        with pytest.raises(ValueError, match=f"{name} must be None or an int >= 1, got {bad!r}"):
            ga.ChunkedAttention(**{name: bad})
    for name in ("memory_budget_bytes", "block_bytes"):
        with pytest.raises(ValueError, match=f"{name} must be an int >= 1, got {bad!r}"):
            ga.ChunkedAttention(**{name: bad})


@pytest.mark.parametrize(
    "position, name", [(0, "batch"), (2, "q_len"), (5, "value_dim"), (7, "memory_budget_bytes")]
)
def test_choose_chunk_sizes_rejects_bad_arguments(position, name):
    args = [1, 1, 4, 4, 2, 2, jnp.float32, 2**20]
    args[position] = 0
    with pytest.raises(ValueError, match=f"{name} must be an int >= 1, got 0"):
        choose_chunk_sizes(*args)
