"""The compute-dtype policy: float32 for bfloat16/float16 on CPU by default, exactly."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gated_attention as ga
from gated_attention import precision
from tests import reference
from tests.helpers import IMPLEMENTATIONS, assert_close, rand


@pytest.mark.parametrize(
    "dtype, policy, backend, expected",
    [
        ("bfloat16", "auto", "cpu", "float32"),
        ("float16", "auto", "cpu", "float32"),
        ("bfloat16", "auto", "gpu", "bfloat16"),
        ("bfloat16", "auto", "tpu", "bfloat16"),
        ("bfloat16", "input", "cpu", "bfloat16"),
        ("float16", "float32", "gpu", "float32"),
        ("float32", "float32", "tpu", "float32"),
        ("float64", "auto", "cpu", "float64"),
        ("float32", "input", "gpu", "float32"),
    ],
)
def test_compute_dtype_table(dtype, policy, backend, expected):
    assert precision.compute_dtype(dtype, policy, backend) == jnp.dtype(expected)


def test_bad_policy_raises_naming_the_argument():
    with pytest.raises(ValueError, match=r"compute_dtype must be one of .*got 'fp32'"):
        ga.AttentionOptions(compute_dtype="fp32")
    with pytest.raises(ValueError, match=r"global_config.compute_dtype must be one of"):
        ga.GlobalConfig(compute_dtype="bf16")


def _op_inputs(dtype, seed=0):
    rng = np.random.default_rng(seed)
    q, _ = rand(rng, (2, 6, 3, 4), dtype)
    k, _ = rand(rng, (2, 7, 3, 4), dtype)
    v, _ = rand(rng, (2, 7, 3, 5), dtype)
    bias, _ = rand(rng, (1, 3, 6, 7), dtype)
    mask = jnp.asarray(rng.random((2, 1, 1, 7)) > 0.3)
    return q, k, v, bias, mask


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_op_default_on_cpu_is_the_float32_computation(implementation, dtype):
    q, k, v, bias, mask = _op_inputs(dtype)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, bias)]
    op = jax.jit(ga.dot_product_attention, static_argnames=("implementation", "options"))
    out = op(q, k, v, bias, mask, implementation=implementation)
    expected = op(*f32, mask, implementation=implementation).astype(dtype)
    raw = op(
        q,
        k,
        v,
        bias,
        mask,
        implementation=implementation,
        options=ga.AttentionOptions(compute_dtype="input"),
    )
    assert out.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected, np.float32))
    # The input policy really computes in the low-precision dtype: a different rounding.
    assert not np.array_equal(np.asarray(raw, np.float32), np.asarray(out, np.float32))


def _module(policy):
    def forward(x, mask, bias):
        global_config = dict(zero_init=False, compute_dtype=policy)
        return ga.Attention(dict(num_head=2), global_config, 8)(x, x, mask, bias)

    return hk.without_apply_rng(hk.transform(forward))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_module_default_on_cpu_is_the_float32_computation(dtype):
    rng = np.random.default_rng(1)
    x, x64 = rand(rng, (3, 5, 8), dtype)
    bias, _ = rand(rng, (2, 5, 5), dtype)
    mask = jnp.asarray(rng.random((3, 1, 1, 5)) > 0.3)
    params = _module("auto").init(jax.random.PRNGKey(0), x, mask, bias)
    assert all(p.dtype == jnp.dtype(dtype) for p in jax.tree.leaves(params))  # AF2's dtypes
    out = jax.jit(_module("auto").apply)(params, x, mask, bias)
    f32 = jax.tree.map(lambda a: a.astype(jnp.float32), (params, x, bias))
    expected = jax.jit(_module("auto").apply)(f32[0], f32[1], mask, f32[2]).astype(dtype)
    assert out.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected, np.float32))
    # Gradients flow back to the low-precision parameters in their own dtype.
    grads = jax.grad(
        lambda p: jnp.sum(_module("auto").apply(p, x, mask, bias).astype(jnp.float32))
    )(params)
    assert all(g.dtype == jnp.dtype(dtype) for g in jax.tree.leaves(grads))
    assert all(bool(jnp.isfinite(g.astype(jnp.float32)).all()) for g in jax.tree.leaves(grads))


def test_global_attention_default_on_cpu_is_the_float32_computation():
    rng = np.random.default_rng(2)
    x, _ = rand(rng, (3, 5, 8), "bfloat16")
    q_mask = jnp.asarray(rng.random((3, 5, 1)) > 0.3)

    def forward(x, q_mask):
        return ga.GlobalAttention(dict(num_head=2), dict(zero_init=False), 8)(x, x, q_mask)

    fn = hk.without_apply_rng(hk.transform(forward))
    params = fn.init(jax.random.PRNGKey(0), x, q_mask)
    out = jax.jit(fn.apply)(params, x, q_mask)
    f32 = jax.tree.map(lambda a: a.astype(jnp.float32), (params, x))
    expected = jax.jit(fn.apply)(f32[0], f32[1], q_mask).astype(jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected, np.float32))


def test_default_bfloat16_is_more_accurate_than_bfloat16_arithmetic():
    q, k, v, bias, mask = _op_inputs("bfloat16", seed=3)
    as64 = lambda a: np.asarray(a.astype(jnp.float64))
    ref = reference.dot_product_attention(*(as64(a) for a in (q, k, v, bias)), np.asarray(mask))
    err = lambda out: np.max(np.abs(as64(out) - ref))
    default = ga.dot_product_attention(q, k, v, bias, mask)
    raw = ga.dot_product_attention(
        q, k, v, bias, mask, options=ga.AttentionOptions(compute_dtype="input")
    )
    assert err(default) <= err(raw)
    assert_close(default, ref, reference.tolerance("bfloat16"))


def test_module_bfloat16_gradients_are_the_float32_computation_on_the_rounded_inputs():
    rng = np.random.default_rng(4)
    x, _ = rand(rng, (3, 5, 8), "bfloat16")
    bias, _ = rand(rng, (2, 5, 5), "bfloat16")
    mask = jnp.asarray(rng.random((3, 1, 1, 5)) > 0.3)
    fn = _module("auto")
    params = fn.init(jax.random.PRNGKey(0), x, mask, bias)

    cot, _ = rand(rng, (3, 5, 8), "bfloat16")  # a cotangent exact in bfloat16

    def loss(params, x):
        return jnp.sum(fn.apply(params, x, mask, bias).astype(jnp.float32) * cot)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
    up = lambda t: jax.tree.map(lambda a: a.astype(jnp.float32), t)
    expected = jax.jit(jax.grad(loss, argnums=(0, 1)))(up(params), up(x))
    # Only the rounding of gradients to bfloat16 differs (x's gradient is the sum of its q_data
    # and m_data parts, each rounded): a few bfloat16 ulps of the largest entry.
    jax.tree.map(
        lambda g, e: np.testing.assert_allclose(
            np.asarray(g, np.float32), np.asarray(e), rtol=0, atol=2**-7 * np.abs(e).max()
        ),
        grads,
        expected,
    )
    # The bfloat16 arithmetic path ('input') is much further from it than that.
    raw = jax.jit(
        jax.grad(
            lambda p, x: jnp.sum(
                _module("input").apply(p, x, mask, bias).astype(jnp.float32) * cot
            ),
            argnums=(0, 1),
        )
    )(params, x)
    worst = lambda t: max(
        float(np.abs(np.asarray(a, np.float32) - np.asarray(e)).max() / np.abs(e).max())
        for a, e in zip(jax.tree.leaves(t), jax.tree.leaves(expected), strict=True)
    )
    assert worst(grads) <= worst(raw)
