"""Tests of gated_attention.chunked against a dense float64 formula written here.

The reference is NumPy in float64: the forward formula and the textbook softmax-attention gradient,
itself checked against central finite differences (test_reference_grads). Inputs are drawn in float64
and rounded to the tested dtype first, so only the implementation's arithmetic is measured. Every
distinct shape and setting costs an XLA compilation (~1 s for fwd+bwd on 2 cores), so the cases
share shapes where they can and go through one module-level jitted function.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gated_attention.chunked import (
    DEFAULT_MEMORY_BUDGET_BYTES,
    choose_chunk_sizes,
    chunked_attention,
    tile_bytes,
)

MASK_VALUE = -1e9
TOLERANCES = {
    jnp.float32: 1e-5,
    jnp.bfloat16: 2e-2,
    jnp.float16: 3e-3,
    jnp.float64: 1e-10,
}
DTYPES = list(TOLERANCES)


def _logits(q, k, bias, mask, scale):
    logits = np.einsum("bnqh,bnkh->bnqk", q, k) * scale  # [B, N, T, S]
    if bias is not None:
        logits = logits + bias
    if mask is not None:
        logits = np.where(mask, logits, MASK_VALUE)
    return logits


def _softmax(logits):
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True)


def reference(q, k, v, bias, mask, scale):
    """Dense softmax attention, head-major, in float64 NumPy: [B, N, T, Hv]."""
    weights = _softmax(_logits(q, k, bias, mask, scale))  # [B, N, T, S]
    return np.einsum("bnqk,bnkh->bnqh", weights, v)


def reference_grads(q, k, v, bias, mask, scale, cotangent):
    """float64 gradients (dq, dk, dv, dbias) of <reference(...), cotangent>, by the textbook
    softmax derivative (checked against finite differences in test_reference_grads)."""
    weights = _softmax(_logits(q, k, bias, mask, scale))  # [B, N, T, S]
    dv = np.einsum("bnqk,bnqh->bnkh", weights, cotangent)  # [B, N, S, Hv]
    dweights = np.einsum("bnqh,bnkh->bnqk", cotangent, v)  # [B, N, T, S]
    dlogits = weights * (dweights - np.sum(weights * dweights, axis=-1, keepdims=True))
    if mask is not None:
        dlogits = np.where(mask, dlogits, 0.0)
    dq = np.einsum("bnqk,bnkh->bnqh", dlogits, k) * scale  # [B, N, T, H]
    dk = np.einsum("bnqk,bnqh->bnkh", dlogits, q) * scale  # [B, N, S, H]
    dbias = None
    if bias is not None:
        axes = tuple(a for a, d in enumerate(bias.shape) if d == 1)
        dbias = np.sum(dlogits, axis=axes, keepdims=True)
    return [dq, dk, dv, dbias]


def make_inputs(seed, shape, value_dim=None, bias_shape=None, mask_shape=None, *, dtype):
    """Random inputs rounded to `dtype`, returned in float64 NumPy (mask: bool)."""
    batch, heads, q_len, kv_len, head_dim = shape
    value_dim = value_dim or head_dim
    rng = np.random.default_rng(seed)

    def rounded(x):
        if dtype == jnp.float64:
            return x
        return np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)

    q = rounded(rng.normal(size=(batch, heads, q_len, head_dim)))
    k = rounded(rng.normal(size=(batch, heads, kv_len, head_dim)))
    v = rounded(rng.normal(size=(batch, heads, kv_len, value_dim)))
    bias = None if bias_shape is None else rounded(rng.normal(size=bias_shape))
    mask = None if mask_shape is None else rng.random(mask_shape) > 0.3
    cotangent = rounded(rng.normal(size=(batch, heads, q_len, value_dim)))
    return q, k, v, bias, mask, cotangent


def x64_if(dtype):
    return jax.enable_x64(True) if dtype == jnp.float64 else contextlib.nullcontext()


def _fwd_bwd(q, k, v, bias, mask, cotangent, **kwargs):
    """chunked_attention's output and its vjp (dq, dk, dv[, dbias]) at `cotangent`."""
    f = lambda q, k, v, b=None: chunked_attention(q, k, v, b, mask, **kwargs)  # noqa: E731
    primals = (q, k, v) if bias is None else (q, k, v, bias)
    out, vjp = jax.vjp(f, *primals)
    return out, vjp(cotangent)


_STATIC = ("scale", "query_chunk_size", "key_chunk_size", "memory_budget_bytes")
# One jitted function for the whole file, so equal shapes and settings compile once.
_fwd_bwd_jit = jax.jit(_fwd_bwd, static_argnames=_STATIC)


def run_chunked(q, k, v, bias, mask, cotangent, *, dtype, use_jit=True, **kwargs):
    """Output and gradients [dq, dk, dv, dbias or None] of chunked_attention, as float64 NumPy."""
    with x64_if(dtype):
        cast = [None if x is None else jnp.asarray(x, dtype) for x in (q, k, v, bias, cotangent)]
        mask_ = None if mask is None else jnp.asarray(mask)
        fn = _fwd_bwd_jit if use_jit else _fwd_bwd
        out, grads = fn(*cast[:4], mask_, cast[4], **kwargs)
        for x, g in zip(cast, grads, strict=False):
            assert g.dtype == x.dtype and g.shape == x.shape
        assert out.dtype == dtype
        result = [
            np.asarray(x.astype(jnp.float32) if dtype != jnp.float64 else x, np.float64)
            for x in (out, *grads)
        ]
    return result[0], result[1:] + [None] * (4 - len(grads))


def assert_close(actual, expected, tol, name=""):
    """|actual - expected| <= tol * (|expected| + max(1, max|expected|)), elementwise."""
    assert np.all(np.isfinite(actual)), f"{name}: non-finite values"
    scale = max(1.0, float(np.max(np.abs(expected))))
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * scale, err_msg=name)


def check(
    shape,
    *,
    dtype=jnp.float32,
    value_dim=None,
    bias_shape=None,
    mask_shape=None,
    scale=0.3,
    seed=0,
    use_jit=True,
    inputs=None,
    tol=None,
    **chunks,
):
    """Compares chunked_attention's output and gradients with the float64 reference."""
    if inputs is None:
        inputs = make_inputs(seed, shape, value_dim, bias_shape, mask_shape, dtype=dtype)
    q, k, v, bias, mask, cotangent = inputs
    out, grads = run_chunked(*inputs, dtype=dtype, use_jit=use_jit, scale=scale, **chunks)
    tol = tol or TOLERANCES[dtype]
    assert_close(out, reference(q, k, v, bias, mask, scale), tol, "output")
    expected = reference_grads(q, k, v, bias, mask, scale, cotangent)
    for name, got, want in zip(("dq", "dk", "dv", "dbias"), grads, expected, strict=True):
        if want is not None:
            assert_close(got, want, tol, name)
    return out, grads


def test_reference_grads():
    # The NumPy reference gradient against central differences of the NumPy reference forward.
    q, k, v, bias, mask, cotangent = make_inputs(
        5, (2, 2, 3, 4, 2), bias_shape=(1, 2, 3, 4), mask_shape=(2, 1, 3, 4), dtype=jnp.float64
    )
    mask[0, 0, 1] = False
    primals = [q, k, v, bias]
    loss = lambda *xs: np.sum(reference(*xs, mask, 0.7) * cotangent)  # noqa: E731
    grads = reference_grads(q, k, v, bias, mask, 0.7, cotangent)
    eps = 1e-6
    for index, (x, grad) in enumerate(zip(primals, grads, strict=True)):
        numeric = np.zeros_like(x)
        for pos in np.ndindex(x.shape):
            plus = [p.copy() for p in primals]
            minus = [p.copy() for p in primals]
            plus[index][pos] += eps
            minus[index][pos] -= eps
            numeric[pos] = (loss(*plus) - loss(*minus)) / (2 * eps)
        np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-8)


# ------------------------------------------------------------------------------------------------
# Values and gradients
# ------------------------------------------------------------------------------------------------

# T=37, S=29 with chunks 8 and 16: neither divides, so both axes are padded.
PADDED = dict(
    shape=(2, 3, 37, 29, 8), value_dim=5, bias_shape=(1, 3, 37, 29), mask_shape=(2, 1, 37, 29)
)
PADDED_CHUNKS = dict(query_chunk_size=8, key_chunk_size=16)


@pytest.mark.parametrize(
    "dtype, use_jit",
    [
        (jnp.float32, True),
        (jnp.bfloat16, True),
        (jnp.float16, True),
        (jnp.float64, True),
        (jnp.float32, False),
    ],
    ids=[
        "float32-jit",
        "bfloat16-jit",
        "float16-jit",
        "float64-jit",
        "float32-eager",
    ],
)
def test_matches_reference(dtype, use_jit):
    check(**PADDED, dtype=dtype, use_jit=use_jit, **PADDED_CHUNKS)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_fully_masked_rows_are_uniform_average_of_real_keys(dtype):
    q, k, v, bias, mask, cotangent = make_inputs(1, **PADDED, dtype=dtype)
    mask[0, 0, 3, :] = False
    mask[1, 0, :, :] = False  # every row of batch 1
    out, grads = check(
        **PADDED, dtype=dtype, inputs=(q, k, v, bias, mask, cotangent), **PADDED_CHUNKS
    )
    uniform = v.mean(axis=2)  # [B, N, Hv], over the 29 real keys only (S is padded to 32)
    tol = TOLERANCES[dtype]
    assert_close(out[0, :, 3], uniform[0], tol, "masked row")
    assert_close(out[1], np.broadcast_to(uniform[1][:, None], out[1].shape), tol, "masked batch")
    # Fully masked rows pass no gradient to q, to the bias or (through the logits) to k.
    dq, dk, dv, dbias = grads
    assert np.all(dq[0, :, 3] == 0) and np.all(dq[1] == 0) and np.all(dk[1] == 0)
    assert np.all(dbias[0, :, 3] == 0)
    assert np.all(np.isfinite(dv)) and np.any(dv[1] != 0)


@pytest.mark.parametrize(
    "bias_shape, mask_shape",
    [
        ((1, 3, 24, 40), (2, 1, 1, 40)),  # AF2's pair bias shared over the batch, key mask
        ((2, 3, 24, 40), (2, 1, 24, 40)),
        ((2, 1, 1, 40), (1, 1, 1, 40)),
        ((1, 1, 24, 40), (2, 3, 24, 40)),
        ((1, 1, 1, 1), (1, 3, 24, 1)),
    ],  # the last mask masks whole rows
)
def test_bias_and_mask_forms(bias_shape, mask_shape):
    check(
        (2, 3, 24, 40, 4),
        bias_shape=bias_shape,
        mask_shape=mask_shape,
        query_chunk_size=8,
        key_chunk_size=16,
    )


def test_no_bias_no_mask_and_large_logits():
    # Logits of several hundred: the online softmax must rescale without overflow. The float32
    # rounding of such logits alone is ~1e-5 absolute, hence the looser tolerance.
    inputs = list(make_inputs(1, (1, 2, 20, 30, 8), dtype=jnp.float32))
    inputs[0] = inputs[0] * 20.0
    check(
        (1, 2, 20, 30, 8), scale=3.0, inputs=inputs, tol=2e-4, query_chunk_size=8, key_chunk_size=8
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_loose_row_bounds_fall_back_to_the_running_maximum(dtype):
    # The forward first shifts each row by an upper bound on its logits. Here the bounds are far
    # above the logits: queries 0-7 are orthogonal to every key (|q| = |k| = 30, q.k = 0, bound
    # 0.3 * 900 = 270), and row 9's bias has +500 on a masked key. exp(-270) underflows in float32,
    # so those blocks must be recomputed with the running maximum; the float64 sums stay normal.
    # Rows 10-15 are ordinary (their block takes the bounded path), row 16 is fully masked.
    check(
        _LOOSE_SHAPE,
        dtype=dtype,
        inputs=_loose_bound_inputs(dtype),
        tol=2e-4 if dtype == jnp.float32 else None,
        query_chunk_size=8,
        key_chunk_size=16,
    )


_LOOSE_SHAPE = (1, 2, 20, 30, 8)


def _loose_bound_inputs(dtype):
    """Inputs whose row bounds are far above the logits (see the test above)."""
    q, k, v, bias, mask, cotangent = make_inputs(
        3, _LOOSE_SHAPE, bias_shape=(1, 2, 20, 30), mask_shape=(1, 1, 20, 30), dtype=dtype
    )
    q, k, bias, mask = q.copy(), k.copy(), bias.copy(), mask.copy()
    q[:, :, :8] = 0.0
    q[:, :, :8, 0] = 30.0
    k = 0.01 * k
    k[..., 1] = 30.0
    mask[:, :, 9, 4] = False
    bias[:, :, 9, 4] = 500.0
    mask[:, :, 16] = False
    return q, k, v, bias, mask, cotangent


def test_loose_row_bounds_under_vmap():
    # One mapped element needs the fallback, the other does not: under vmap the fallback runs for
    # both (the cond's predicate covers the mapped axis), and both must match the reference.
    loose = _loose_bound_inputs(jnp.float32)
    plain = make_inputs(
        4, _LOOSE_SHAPE, bias_shape=(1, 2, 20, 30), mask_shape=(1, 1, 20, 30), dtype=jnp.float32
    )
    stacked = [np.stack([a, b]) for a, b in zip(loose, plain, strict=True)]

    def fwd(q, k, v, bias, mask):
        return chunked_attention(
            q, k, v, bias, mask, scale=0.3, query_chunk_size=8, key_chunk_size=16
        )

    args = [jnp.asarray(x) if x.dtype == bool else jnp.asarray(x, jnp.float32) for x in stacked]
    out = np.asarray(jax.jit(jax.vmap(fwd))(*args[:5]), np.float64)
    for i, inputs in enumerate((loose, plain)):
        assert_close(out[i], reference(*inputs[:5], 0.3), 2e-4, f"element {i}")


@pytest.mark.parametrize(
    "q_len, kv_len, chunks",
    [(1, 1, (None, None)), (1, 7, (4, 4)), (7, 1, (4, 4)), (5, 9, (64, 64)), (6, 10, (1, 3))],
)
def test_lengths_and_chunk_sizes(q_len, kv_len, chunks):
    check(
        (2, 2, q_len, kv_len, 4),
        bias_shape=(1, 2, q_len, kv_len),
        mask_shape=(2, 1, 1, kv_len),
        query_chunk_size=chunks[0],
        key_chunk_size=chunks[1],
    )


def test_automatic_chunk_sizes_with_small_budget():
    # A budget of 16 KiB forces several tiles in both directions on this shape.
    tq, tk = choose_chunk_sizes(2, 2, 40, 48, 4, 4, jnp.float32, 2**14)
    assert tq < 40 and tk < 48
    check(
        (2, 2, 40, 48, 4),
        bias_shape=(2, 1, 1, 48),
        mask_shape=(2, 1, 40, 48),
        memory_budget_bytes=2**14,
    )


def test_vmap():
    q, k, v, bias, mask, cotangent = make_inputs(
        3, (2, 2, 12, 10, 4), bias_shape=(1, 2, 12, 10), mask_shape=(2, 1, 1, 10), dtype=jnp.float32
    )
    stacked = [np.stack([x, 2 * x]) for x in (q, k, v, cotangent)]  # a leading vmapped axis

    def fwd_bwd(q, k, v, cotangent):
        f = lambda q, k, v: chunked_attention(  # noqa: E731
            q,
            k,
            v,
            jnp.asarray(bias, jnp.float32),
            jnp.asarray(mask),
            scale=0.5,
            query_chunk_size=4,
            key_chunk_size=4,
        )
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(cotangent)

    args = [jnp.asarray(x, jnp.float32) for x in stacked]
    # The forward's fallback stays a lax.cond under vmap (not a select computing both branches).
    assert "cond[" in str(jax.make_jaxpr(jax.vmap(fwd_bwd))(*args))
    out, grads = jax.jit(jax.vmap(fwd_bwd))(*args)
    for i in range(2):
        xs = [x[i] for x in stacked]
        assert_close(np.asarray(out[i], np.float64), reference(*xs[:3], bias, mask, 0.5), 1e-5)
        expected = reference_grads(*xs[:3], bias, mask, 0.5, xs[3])
        for got, want in zip(grads, expected[:3], strict=True):
            assert_close(np.asarray(got[i], np.float64), want, 1e-5)


@settings(max_examples=25, deadline=None)
@given(
    dims=st.tuples(
        st.integers(1, 2),
        st.integers(1, 3),
        st.integers(1, 20),
        st.integers(1, 20),
        st.integers(1, 6),
    ),
    query_chunk=st.integers(1, 24),
    key_chunk=st.integers(1, 24),
    bias_full=st.tuples(*[st.booleans()] * 4),
    mask_full=st.tuples(*[st.booleans()] * 4),
    seed=st.integers(0, 2**16),
)
def test_random_shapes_and_chunks(dims, query_chunk, key_chunk, bias_full, mask_full, seed):
    full = dims[:4]
    bias_shape = tuple(d if f else 1 for d, f in zip(full, bias_full, strict=True))
    mask_shape = tuple(d if f else 1 for d, f in zip(full, mask_full, strict=True))
    check(
        dims,
        bias_shape=bias_shape,
        mask_shape=mask_shape,
        seed=seed,
        query_chunk_size=query_chunk,
        key_chunk_size=key_chunk,
    )


# ------------------------------------------------------------------------------------------------
# Memory bound
# ------------------------------------------------------------------------------------------------


def _all_shapes(jaxpr):
    """Shapes of every equation output in a jaxpr, recursing into sub-jaxprs (loops, custom_vjp)."""
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield tuple(getattr(var.aval, "shape", ()))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from _all_shapes(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from _all_shapes(sub)


@pytest.mark.parametrize("bias_shape", [None, (1, 2, 256, 256)])
def test_forward_and_backward_hold_no_logits_sized_array(bias_shape):
    batch, heads, length, head_dim = 4, 2, 256, 16
    q = jnp.ones((batch, heads, length, head_dim), jnp.float32)
    mask = jnp.ones((batch, 1, 1, length), bool)
    bias = None if bias_shape is None else jnp.ones(bias_shape, jnp.float32)

    def fwd_bwd(q, k, v, bias):
        f = lambda q, k, v, b: chunked_attention(  # noqa: E731
            q, k, v, b, mask, scale=0.25, query_chunk_size=32, key_chunk_size=32
        )
        out, vjp = jax.vjp(f, q, k, v, bias)
        return out, vjp(out)

    jaxpr = jax.make_jaxpr(fwd_bwd)(q, q, q, bias)
    sizes = [(int(np.prod(s)), s) for s in _all_shapes(jaxpr.jaxpr)]
    # Only the bias and its gradient (the bias's own shape) may hold T*S elements.
    big = [s for n, s in sizes if n >= length * length and s != bias_shape]
    assert not big, f"logits-sized arrays: {big}"
    assert max(n for n, _ in sizes) >= 32 * 32 * batch * heads  # the tiles are there
    if bias is not None:  # what XLA allocates: far less than one float32 [B, N, T, S] buffer
        compiled = jax.jit(fwd_bwd).lower(q, q, q, bias).compile()
        assert compiled.memory_analysis().temp_size_in_bytes < batch * heads * length**2 * 4 // 8


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


@pytest.mark.parametrize("name", ["query_chunk_size", "key_chunk_size", "memory_budget_bytes"])
@pytest.mark.parametrize("bad", [0, -4, 2.5, True, "8"])
def test_bad_chunk_sizes_raise(name, bad):
    q = jnp.ones((1, 1, 4, 2))
    with pytest.raises(ValueError, match=f"{name} must be a positive int"):
        chunked_attention(q, q, q, scale=1.0, **{name: bad})


def test_choose_chunk_sizes_rejects_bad_arguments():
    with pytest.raises(ValueError, match="memory_budget_bytes must be a positive int"):
        choose_chunk_sizes(1, 1, 4, 4, 2, 2, jnp.float32, 0)
    with pytest.raises(ValueError, match="q_len must be a positive int"):
        choose_chunk_sizes(1, 1, 0, 4, 2, 2, jnp.float32, 2**20)


@pytest.mark.parametrize(
    "shapes, match",
    [
        ({"bias": (1, 1, 3, 4)}, "bias must have rank 4 with every dimension 1 or equal to"),
        ({"mask": (1, 4)}, "mask must have rank 4"),
        ({"query": (1, 4, 2)}, "query must have rank 4"),
        ({"key": (1, 1, 4, 3)}, "key shape"),
        ({"value": (1, 1, 5, 2)}, "value shape"),
        ({"query": (1, 1, 0, 2)}, "non-empty axes"),
    ],
)
def test_bad_shapes_raise(shapes, match):
    args = {"query": (1, 1, 4, 2), "key": (1, 1, 4, 2), "value": (1, 1, 4, 2), **shapes}
    arrays = {n: jnp.ones(s, bool if n == "mask" else jnp.float32) for n, s in args.items()}
    with pytest.raises(ValueError, match=match):
        chunked_attention(**arrays, scale=1.0)


def test_float_mask_raises():
    q = jnp.ones((1, 1, 4, 2))
    with pytest.raises(ValueError, match="mask must be a bool array, got dtype float32"):
        chunked_attention(q, q, q, mask=jnp.ones((1, 1, 1, 4), jnp.float32), scale=1.0)
