"""dot_product_attention against the float64 reference: every implementation, dtype, mask and bias."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gated_attention as ga
from tests import reference
from tests.helpers import DTYPES, IMPLEMENTATIONS, assert_close, rand

B, T, S, N, H, HV = 2, 5, 7, 3, 4, 6

# The reference tests run low-precision inputs in their own dtype (the 'input' policy): on CPU the
# default policy computes them in float32, which test_precision.py checks separately.
RAW = ga.AttentionOptions(compute_dtype="input")

# name -> (bias shape, mask shape) in [B, N, T, S] terms; None = absent.
FORMS = {
    "plain": (None, None),
    "key_mask": (None, (B, 1, 1, S)),
    "shared_bias+key_mask": ((1, N, T, S), (B, 1, 1, S)),
    "batched_bias+query_key_mask": ((B, N, T, S), (B, 1, T, S)),
    "key_bias+full_mask": ((B, 1, 1, S), (B, N, T, S)),
    "head_bias+shared_mask": ((1, N, 1, 1), (1, 1, T, S)),
}


def _problem(dtype, form, seed=0, shape=(B, T, S, N, H, HV)):
    b, t, s, n, h, hv = shape
    rng = np.random.default_rng(seed)
    q, q64 = rand(rng, (b, t, n, h), dtype)
    k, k64 = rand(rng, (b, s, n, h), dtype)
    v, v64 = rand(rng, (b, s, n, hv), dtype)
    bias_shape, mask_shape = form
    bias = bias64 = mask = None
    if bias_shape is not None:
        bias, bias64 = rand(rng, bias_shape, dtype)
    if mask_shape is not None:
        mask = jnp.asarray(rng.random(mask_shape) > 0.3)
    return (q, k, v, bias, mask), (
        q64,
        k64,
        v64,
        bias64,
        None if mask is None else np.asarray(mask),
    )


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", list(FORMS))
def test_forward_matches_reference(implementation, dtype, form):
    (q, k, v, bias, mask), ref_inputs = _problem(dtype, FORMS[form])
    op = jax.jit(
        functools.partial(ga.dot_product_attention, implementation=implementation, options=RAW)
    )
    out = op(q, k, v, bias, mask)
    assert out.dtype == jnp.dtype(dtype) and out.shape == (B, T, N, HV)
    assert_close(out, reference.dot_product_attention(*ref_inputs), reference.tolerance(dtype))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
@pytest.mark.parametrize(
    "form", ["shared_bias+key_mask", "batched_bias+query_key_mask", "head_bias+shared_mask"]
)
def test_gradients_match_reference(implementation, dtype, form):
    (q, k, v, bias, mask), (q64, k64, v64, bias64, mask64) = _problem(dtype, FORMS[form], seed=1)
    cot, cot64 = rand(np.random.default_rng(2), (B, T, N, HV), dtype)

    acc = jnp.promote_types(dtype, jnp.float32)

    def loss(q, k, v, bias):
        out = ga.dot_product_attention(
            q, k, v, bias, mask, implementation=implementation, options=RAW
        )
        return jnp.sum(out.astype(acc) * cot.astype(acc))

    def ref_loss(q, k, v, bias):
        out = reference.dot_product_attention(q, k, v, bias, mask64, xp=jnp)
        return jnp.sum(out * cot64)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias)
    ref = jax.grad(ref_loss, argnums=(0, 1, 2, 3))(q64, k64, v64, bias64)
    for name, g, r, x in zip("qkvb", grads, ref, (q, k, v, bias), strict=True):
        assert g.dtype == x.dtype and g.shape == x.shape, name
        assert_close(g, r, reference.grad_tolerance(dtype), err_msg=f"d{name}")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_rows_are_uniform_and_finite(implementation, dtype):
    (q, k, v, bias, _), (q64, k64, v64, bias64, _) = _problem(dtype, FORMS["shared_bias+key_mask"])
    mask = np.ones((B, N, T, S), bool)
    mask[0, :, 1] = False  # query row 1 of batch 0 sees nothing, in every head
    mask[1] = False  # batch 1 sees nothing at all
    mask = jnp.asarray(mask)

    def loss(q, k, v, bias):
        out = ga.dot_product_attention(
            q, k, v, bias, mask, implementation=implementation, options=RAW
        )
        return jnp.sum(out.astype(jnp.float32)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        q, k, v, bias
    )
    assert all(bool(jnp.isfinite(g.astype(jnp.float32)).all()) for g in (out, *grads))
    uniform = v64.mean(axis=1)  # [B, N, HV]
    tol = reference.tolerance(dtype)
    assert_close(out[0, 1], uniform[0], tol)
    assert_close(out[1], np.broadcast_to(uniform[1], (T, N, HV)), tol)
    assert_close(out, reference.dot_product_attention(q64, k64, v64, bias64, np.asarray(mask)), tol)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_masked_keys_get_no_gradient(implementation):
    (q, k, v, bias, _), _ = _problem("float32", FORMS["batched_bias+query_key_mask"])
    mask = jnp.asarray(np.random.default_rng(3).random((B, 1, T, S)) > 0.5)
    grad_bias = jax.grad(
        lambda b: jnp.sum(ga.dot_product_attention(q, k, v, b, mask, implementation=implementation))
    )(bias)
    assert float(jnp.max(jnp.abs(jnp.where(mask, 0.0, grad_bias)))) == 0.0
    assert float(jnp.max(jnp.abs(grad_bias))) > 0.0


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_eager_equals_jit_and_layouts_agree(implementation):
    (q, k, v, bias, mask), _ = _problem("float32", FORMS["shared_bias+key_mask"])
    op = functools.partial(ga.dot_product_attention, implementation=implementation)
    eager = op(q, k, v, bias, mask)
    np.testing.assert_allclose(eager, jax.jit(op)(q, k, v, bias, mask), rtol=1e-6, atol=1e-6)
    head_major = op(*(jnp.swapaxes(x, 1, 2) for x in (q, k, v)), bias, mask, layout="BNTH")
    np.testing.assert_allclose(eager, jnp.swapaxes(head_major, 1, 2), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_extra_batch_axes_and_shared_bias(implementation):
    rng = np.random.default_rng(4)
    q, q64 = rand(rng, (2, 3, T, N, H), "float32")
    k, k64 = rand(rng, (2, 3, S, N, H), "float32")
    v, v64 = rand(rng, (2, 3, S, N, HV), "float32")
    shared, shared64 = rand(rng, (1, 1, N, T, S), "float32")
    mixed, mixed64 = rand(rng, (2, 1, 1, 1, S), "float32")
    mask = jnp.asarray(rng.random((1, 3, 1, 1, S)) > 0.3)
    out = ga.dot_product_attention(q, k, v, [shared, mixed], mask, implementation=implementation)
    ref = reference.dot_product_attention(q64, k64, v64, shared64 + mixed64, np.asarray(mask))
    assert_close(out, ref, reference.tolerance("float32"))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_unbatched_inputs_and_custom_scale(implementation):
    rng = np.random.default_rng(5)
    q, q64 = rand(rng, (T, N, H), "float32")
    k, k64 = rand(rng, (S, N, H), "float32")
    v, v64 = rand(rng, (S, N, HV), "float32")
    out = ga.dot_product_attention(q, k, v, scale=0.3, implementation=implementation)
    assert_close(
        out,
        reference.dot_product_attention(q64, k64, v64, scale=0.3),
        reference.tolerance("float32"),
    )


def test_auto_records_its_choice():
    (q, k, v, bias, mask), ref_inputs = _problem("float32", FORMS["shared_bias+key_mask"])
    with ga.record_implementation_choices() as choices:
        out = ga.dot_product_attention(q, k, v, bias, mask)
    assert [c["requested"] for c in choices] == ["auto"]
    assert choices[0]["chosen"] in IMPLEMENTATIONS and choices[0]["reason"]
    assert_close(out, reference.dot_product_attention(*ref_inputs), reference.tolerance("float32"))


def test_auto_chooses_by_memory_budget():
    small = jax.ShapeDtypeStruct((2, 4, 64, 32), jnp.float32)
    big = jax.ShapeDtypeStruct((1, 8, 16384, 32), jnp.float32)
    assert ga.choose_implementation(small, small, small)[0] == "xla"
    expected = "chunked" if "chunked" in IMPLEMENTATIONS else "xla"
    assert ga.choose_implementation(big, big, big)[0] == expected
    tiny_budget = ga.choose_implementation(small, small, small, memory_budget_bytes=1024)[0]
    assert tiny_budget == expected


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_two_biases_match_their_sum_forward_and_gradients(implementation):
    """A pair bias shared over the batch plus a per-batch key bias (AF2 before 2023, ColabFold)."""
    rng = np.random.default_rng(6)
    q, q64 = rand(rng, (B, T, N, H), "float32")
    k, k64 = rand(rng, (B, S, N, H), "float32")
    v, v64 = rand(rng, (B, S, N, HV), "float32")
    pair, pair64 = rand(rng, (1, N, T, S), "float32")
    keys, keys64 = rand(rng, (B, 1, 1, S), "float32")

    def loss(q, pair, keys):
        out = ga.dot_product_attention(q, k, v, [pair, keys], implementation=implementation)
        return jnp.sum(out**2)

    def ref_loss(q, pair, keys):
        return jnp.sum(reference.dot_product_attention(q, k64, v64, pair + keys, xp=jnp) ** 2)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, pair, keys)
    ref = jax.grad(ref_loss, argnums=(0, 1, 2))(q64, pair64, keys64)
    for g, r, x in zip(grads, ref, (q, pair, keys), strict=True):
        assert g.shape == x.shape  # each bias gets the gradient summed to its own shape
        assert_close(g, r, reference.grad_tolerance("float32"))


@pytest.mark.parametrize("layout", ["BTNH", "BNTH"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_row_tiles_match_reference_forward_and_gradients(monkeypatch, layout, dtype):
    """'xla' in tiles of 2 batch rows (5 rows: a remainder tile), with a shared and a batched bias
    and a batched mask, bfloat16 computed in float32 inside the tiles. The layout change happens
    per tile: no head-major copy of the whole query, key or value is made."""
    from gated_attention import xla

    b = 5
    monkeypatch.setattr(xla, "TILE_BYTES", 2 * 4 * N * T * S)  # 2 rows per tile
    assert xla.row_tile(b, N, T, S) == 2
    rng = np.random.default_rng(7)
    q, q64 = rand(rng, (b, T, N, H), dtype)
    k, k64 = rand(rng, (b, S, N, H), dtype)
    v, v64 = rand(rng, (b, S, N, HV), dtype)
    pair, pair64 = rand(rng, (1, N, T, S), dtype)
    keys, keys64 = rand(rng, (b, 1, 1, S), dtype)
    mask = np.random.default_rng(8).random((b, 1, T, S)) > 0.3
    mask[1, 0, 2] = False  # a fully masked query row
    cot, cot64 = rand(np.random.default_rng(9), (b, T, N, HV), dtype)
    to_layout = (lambda x: x) if layout == "BTNH" else (lambda x: jnp.swapaxes(x, 1, 2))
    options = ga.AttentionOptions(compute_dtype="float32")

    def loss(q, k, v, pair, keys):
        out = ga.dot_product_attention(
            *(to_layout(x) for x in (q, k, v)),
            [pair, keys],
            jnp.asarray(mask),
            implementation="xla",
            layout=layout,
            options=options,
        )
        out = to_layout(out)
        return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32)), out

    def ref_loss(q, k, v, pair, keys):
        out = reference.dot_product_attention(q, k, v, pair + keys, mask, xp=jnp)
        return jnp.sum(out * cot64)

    args = (q, k, v, pair, keys)
    top_level = jax.make_jaxpr(loss)(*args).jaxpr.eqns
    assert any(e.primitive.name in ("scan", "while") for e in top_level)  # tiled
    for e in top_level:  # the only transposes outside the loop are of the caller's own swaps
        if e.primitive.name == "transpose" and layout == "BTNH":
            raise AssertionError(f"a whole-batch transpose outside the tiles: {e}")
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=range(5), has_aux=True))(*args)
    assert out.dtype == jnp.dtype(dtype)
    tol = reference.tolerance(dtype)  # the output is rounded to dtype
    assert_close(out, reference.dot_product_attention(q64, k64, v64, pair64 + keys64, mask), tol)
    ref = jax.grad(ref_loss, argnums=range(5))(q64, k64, v64, pair64, keys64)
    for name, g, r, x in zip(["q", "k", "v", "pair", "keys"], grads, ref, args, strict=True):
        assert g.dtype == x.dtype and g.shape == x.shape, name
        assert_close(g, r, reference.grad_tolerance(dtype), err_msg=f"d{name}")
