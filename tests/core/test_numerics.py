"""numerics.py: the compute-dtype policy (float32 for bfloat16/float16 on CPU by default, exactly)
and the masking helpers every implementation shares."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gated_attention as ga
from gated_attention.core import numerics
from gated_attention_tools.family_benchmark import random_params
from tests import reference
from tests.helpers import assert_close, rand

IMPLEMENTATIONS = ("xla", "chunked")


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
    assert numerics.compute_dtype(dtype, policy, backend) == jnp.dtype(expected)


def test_bad_policy_raises_naming_the_argument():
    with pytest.raises(ValueError, match=r"compute_dtype must be one of .*got 'fp32'"):
        ga.dot_product_attention(*_op_inputs("float32")[:3], compute_dtype="fp32")
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
    op = jax.jit(ga.dot_product_attention, static_argnames=("implementation", "compute_dtype"))
    out = op(q, k, v, bias, mask, implementation=implementation)
    expected = op(*f32, mask, implementation=implementation).astype(dtype)
    raw = op(
        q,
        k,
        v,
        bias,
        mask,
        implementation=implementation,
        compute_dtype="input",
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
    params = random_params(_module("auto"), (x, mask, bias))
    assert all(p.dtype == jnp.dtype(dtype) for p in jax.tree.leaves(params))  # AF2's dtypes
    out = jax.jit(_module("auto").apply)(params, x, mask, bias)
    f32 = jax.tree.map(lambda a: a.astype(jnp.float32), (params, x, bias))
    expected = jax.jit(_module("auto").apply)(f32[0], f32[1], mask, f32[2]).astype(dtype)
    assert out.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected, np.float32))
    # Gradients flow back to the low-precision parameters in their own dtype.
    grads = jax.jit(
        jax.grad(lambda p: jnp.sum(_module("auto").apply(p, x, mask, bias).astype(jnp.float32)))
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
    params = random_params(fn, (x, q_mask))
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
    op = jax.jit(ga.dot_product_attention, static_argnames="compute_dtype")  # one program each
    default = op(q, k, v, bias, mask)
    raw = op(q, k, v, bias, mask, compute_dtype="input")
    assert err(default) <= err(raw)
    assert_close(default, ref, reference.tolerance("bfloat16"))


def test_module_bfloat16_gradients_are_the_float32_computation_on_the_rounded_inputs():
    rng = np.random.default_rng(4)
    x, _ = rand(rng, (3, 5, 8), "bfloat16")
    bias, _ = rand(rng, (2, 5, 5), "bfloat16")
    mask = jnp.asarray(rng.random((3, 1, 1, 5)) > 0.3)
    fn = _module("auto")
    params = random_params(fn, (x, mask, bias))

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


def test_zero_dead_inputs_zeroes_dead_queries_and_keys_in_either_layout():
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.normal(size=(2, 3, 4, 2)))  # [B, N, T, H]
    k = jnp.asarray(rng.normal(size=(2, 3, 5, 2)))  # [B, N, S, H]
    v = jnp.asarray(rng.normal(size=(2, 3, 5, 6)))
    mask = np.ones((2, 1, 4, 5), bool)
    mask[0, 0, 1] = False  # query 1 of batch 0 sees no key
    mask[1, 0, :, 3] = False  # key 3 of batch 1 is seen by no query
    mask[1, 0, 2, 4] = False  # key 4 of batch 1 is masked for one query only: kept
    live = jnp.asarray(mask.any(axis=3)), jnp.asarray(mask.any(axis=2))  # [B, 1, T], [B, 1, S]
    zq, zk, zv = numerics.zero_dead_inputs(q, k, v, *live, head_major=True)
    live_q = mask.any(axis=3)[..., None]  # [B, 1, T, 1]
    live_k = mask.any(axis=2)[..., None]  # [B, 1, S, 1]
    np.testing.assert_array_equal(zq, np.where(live_q, q, 0))
    np.testing.assert_array_equal(zk, np.where(live_k, k, 0))
    np.testing.assert_array_equal(zv, np.where(live_k, v, 0))
    swap = lambda x: jnp.swapaxes(x, 1, 2)
    btnh = numerics.zero_dead_inputs(swap(q), swap(k), swap(v), *live, head_major=False)
    for got, want in zip(btnh, (zq, zk, zv), strict=True):
        np.testing.assert_array_equal(swap(got), want)
    assert numerics.zero_dead_inputs(q, k, v, None, None, head_major=True) == (q, k, v)


def test_mask_logits_adds_a_key_mask_and_selects_a_query_mask():
    logits = jnp.asarray(np.random.default_rng(6).normal(size=(1, 1, 2, 3)))
    key_mask = jnp.asarray([[[[True, False, True]]]])
    added = numerics.mask_logits(logits, key_mask)
    np.testing.assert_array_equal(added, logits + np.where(key_mask, 0.0, numerics.MASK_VALUE))
    full = jnp.asarray([[[[True, False, True], [False, False, True]]]])
    nan_logits = logits.at[0, 0, 1, 0].set(jnp.nan)  # masked for that row only
    selected = numerics.mask_logits(nan_logits, full)
    np.testing.assert_array_equal(selected, np.where(full, nan_logits, numerics.MASK_VALUE))
