"""Tests for gated_attention.parallel.row_loop: subbatching over the batch axis."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gated_attention.parallel.row_loop import subbatch, subbatch_size_for_budget
from tests.helpers import all_eqns

B, N, T, S, H = 10, 2, 5, 6, 4  # batch, heads, queries, keys, channels


def attention(q, k, v, bias, mask):
    """Head-major softmax attention: q [B, N, T, H], k/v [B, N, S, H], bias/mask [1|B, N, T, S]."""
    logits = jnp.einsum("bnqh,bnkh->bnqk", q, k) * H**-0.5  # [B, N, T, S]
    if bias is not None:
        logits = logits + bias
    if mask is not None:
        logits = jnp.where(mask, logits, -1e9)
    return jnp.einsum("bnqk,bnkh->bnqh", jax.nn.softmax(logits, axis=-1), v)  # [B, N, T, H]


def _inputs(bias_batch=1, seed=0):
    """q, k, v, bias, mask as jax arrays (drawn with NumPy: eager jax.random compiles slowly)."""
    rng = np.random.default_rng(seed)
    normal = functools.partial(rng.standard_normal, dtype=np.float32)
    mask = rng.random((B, 1, 1, S)) < 0.7
    mask[0] = False  # One fully masked batch row.
    return tuple(
        map(
            jnp.asarray,
            (
                normal((B, N, T, H)),
                normal((B, N, S, H)),
                normal((B, N, S, H)),
                normal((bias_batch, N, T, S)),
                mask,
            ),
        )
    )


def _assert_close(actual, expected):
    """Within 1 ulp in float32 (and not just allclose)."""
    jax.tree.map(
        lambda a, e: np.testing.assert_array_max_ulp(np.asarray(a), np.asarray(e), 1),
        actual,
        expected,
    )


def test_matches_single_call_eager():
    args = _inputs()
    _assert_close(subbatch(attention, args, subbatch_size=4), attention(*args))


@pytest.mark.parametrize(
    "size, bias_batch", [(1, 1), (3, 1), (4, 1), (10, 1), (16, 1), (None, 1), (4, B)]
)
def test_matches_single_call_under_jit(size, bias_batch):
    args = _inputs(bias_batch)
    run = jax.jit(lambda *a: subbatch(attention, a, subbatch_size=size))
    _assert_close(run(*args), jax.jit(attention)(*args))


@pytest.mark.parametrize(
    "size, traced", [(4, [4, 2]), (5, [5]), (3, [3, 1]), (10, [10]), (16, [10])]
)
def test_one_compiled_body_plus_remainder_and_shared_args_passed_whole(size, traced):
    seen = []

    def fn(q, k, v, bias, mask):
        seen.append((q.shape[0], k.shape[0], bias.shape[0], mask))
        return attention(q, k, v, bias, mask)

    q, k, v, bias, _ = _inputs()
    jax.eval_shape(lambda *a: subbatch(fn, a, subbatch_size=size), q, k, v, bias, None)
    assert seen == [(n, n, 1, None) for n in traced]


def test_none_args_and_explicit_batched():
    q, k, v, bias, mask = _inputs(bias_batch=B)
    seen = []

    def fn(q, k, v, bias, mask):
        seen.append(bias.shape[0])
        return attention(q, k, v, bias[:1], mask)

    out = jax.jit(
        lambda q, k, v, bias: subbatch(
            fn, [q, k, v, bias, None], subbatch_size=3, batched=[True, True, True, False, False]
        )
    )(q, k, v, bias)
    assert seen == [B, B]  # bias has the batch size but was declared shared: passed whole.
    _assert_close(out, attention(q, k, v, bias[:1], None))


def test_pytree_outputs_on_another_axis():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((3, B, 4), dtype=np.float32))  # batch on axis 1
    y = jnp.asarray(rng.standard_normal((1, 1, 4), dtype=np.float32))  # shared

    def fn(x, y):
        return {"sum": x + y, "stats": (jnp.max(x, axis=-1), x[..., None] * 2.0)}

    out = jax.jit(lambda x, y: subbatch(fn, [x, y], subbatch_size=4, axis=1))(x, y)
    expected = jax.jit(fn)(x, y)
    assert jax.tree.structure(out) == jax.tree.structure(expected)
    jax.tree.map(np.testing.assert_array_equal, out, expected)
    # axis=-2 is axis 1 of both inputs, but not of the rank-2 output leaf: refused, not mixed up.
    with pytest.raises(
        ValueError,
        match=r"fn output\['stats'\]\[0\] has shape \(3, 4\), but "
        "subbatch concatenates outputs along axis -2",
    ):
        jax.eval_shape(lambda x, y: subbatch(fn, [x, y], subbatch_size=4, axis=-2), x, y)


def test_gradients_match():
    q, k, v, bias, mask = _inputs()

    def loss(q, bias, size):
        out = subbatch(attention, [q, k, v, bias, mask], subbatch_size=size)
        return jnp.sum(jnp.sin(out))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    expected = grad(q, bias, None)
    got = grad(q, bias, 4)  # 4, 4 and a remainder of 2
    assert got[1].shape == bias.shape
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6), got, expected)


def test_recomputed_tiles_give_the_gradients_from_fresh_buffers():
    """remat=True (each tile recomputed in the backward pass): the gradients of cut, shared and
    closed-over values are the single call's, over full tiles and a remainder; and no
    batch-sized buffer is constant zeros (the output and the cut args' cotangents are written
    into zeros made from the data, mapping._fresh_zeros): XLA merges constant zeros of one shape
    across a model and creates them for the earliest user, so they are held far too long."""
    q, k, v, bias, mask = _inputs()
    w = jnp.asarray(np.random.default_rng(2).standard_normal((H, H), dtype=np.float32))

    def loss(q, k, bias, w, size):
        fn = lambda q, k, v, bias, mask: attention(q @ w, k, v, bias, mask)  # noqa: E731
        out = subbatch(fn, [q, k, v, bias, mask], subbatch_size=size, remat=True)
        return jnp.sum(jnp.sin(out))

    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    expected = jax.jit(grad, static_argnums=4)(q, k, bias, w, None)
    got = jax.jit(grad, static_argnums=4)(q, k, bias, w, 4)  # 4, 4 and a remainder of 2
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6), got, expected)
    jaxpr = jax.make_jaxpr(grad, static_argnums=4)(q, k, bias, w, 4).jaxpr
    constant_zeros = [
        e.params["shape"]
        for e in all_eqns(jaxpr)
        if e.primitive.name == "broadcast_in_dim"
        and isinstance(e.invars[0], jax.extend.core.Literal)
        and e.invars[0].val == 0
        and e.params["shape"][0] == B
    ]
    assert constant_zeros == []


def test_scalar_output_is_rejected():
    q, k, v, bias, mask = _inputs()
    with pytest.raises(
        ValueError,
        match=r"fn output has shape \(\), but subbatch concatenates "
        "outputs along axis 0, so it needs the subbatch size 4 there",
    ):
        jax.eval_shape(
            lambda *a: subbatch(lambda *b: jnp.sum(attention(*b)), a, subbatch_size=4),
            q,
            k,
            v,
            bias,
            mask,
        )


@pytest.mark.parametrize("size", [0, -2, 2.5, True, "4"])
def test_bad_subbatch_size(size):
    with pytest.raises(
        ValueError, match=f"subbatch_size must be None or an int >= 1, got {re.escape(repr(size))}"
    ):
        subbatch(attention, _inputs(), subbatch_size=size)


def test_disagreeing_batch_sizes():
    q, k, v, bias, mask = _inputs()
    with pytest.raises(
        ValueError,
        match=r"args\[2\] has size 7 along axis 0, but the batch size "
        r"is 10 \(from args\[0\]\); expected 10, or 1 to share",
    ):
        subbatch(attention, [q, k, v[:7], bias, mask], subbatch_size=4)
    with pytest.raises(
        ValueError,
        match=r"args\[1\] has size 7 along axis 0, but the batch size "
        r"is 10 \(from args\[0\]\); batched args must agree",
    ):
        subbatch(
            attention,
            [q, k[:7], v, bias, mask],
            subbatch_size=4,
            batched=[True, True, True, False, False],
        )


def test_axis_and_batched_errors():
    q, k, v, bias, mask = _inputs()
    with pytest.raises(
        ValueError,
        match=r"axis=4 is out of range for args\[0\] of shape "
        r"\(10, 2, 5, 4\) \(rank 4\)",
    ):
        subbatch(attention, [q, k, v, bias, mask], subbatch_size=4, axis=4)
    with pytest.raises(TypeError, match="axis must be an int, got 0.0"):
        subbatch(attention, [q, k, v, bias, mask], subbatch_size=4, axis=0.0)
    with pytest.raises(ValueError, match=r"batched has 2 entries, expected one per arg \(5\)"):
        subbatch(attention, [q, k, v, bias, mask], subbatch_size=4, batched=[True, True])
    with pytest.raises(ValueError, match=r"batched\[4\] is True but args\[4\] is None"):
        subbatch(attention, [q, k, v, bias, None], subbatch_size=4, batched=[True] * 5)


@pytest.mark.parametrize(
    "batch, per_example, budget, expected",
    [
        (10, 100, 450, 4),
        (10, 100, 400, 4),
        (10, 100, 399, 3),
        (10, 100, 50, 1),
        (10, 100, 10**9, 10),
        (7, 2.5, 10.0, 4),
    ],
)
def test_subbatch_size_for_budget(batch, per_example, budget, expected):
    assert subbatch_size_for_budget(batch, per_example, budget) == expected


def test_subbatch_size_for_budget_errors():
    with pytest.raises(ValueError, match="batch must be an int >= 1, got 0"):
        subbatch_size_for_budget(0, 100, 400)
    with pytest.raises(ValueError, match="bytes_per_example must be a positive number, got 0"):
        subbatch_size_for_budget(10, 0, 400)
    with pytest.raises(ValueError, match="memory_budget_bytes must be a positive number, got -1"):
        subbatch_size_for_budget(10, 100, -1)


@pytest.mark.parametrize(
    "remat",
    [False, True, jax.checkpoint_policies.dots_with_no_batch_dims_saveable],
    ids=["keep", "recompute", "policy"],
)
def test_gradients_of_closed_over_parameters_with_a_remainder(remat):
    """Parameters closed over by fn (jit arguments, so traced) are read by the full tiles and the
    remainder alike: each remat setting gives the single call's gradients (with a policy the
    residuals kept per tile must line up with those the backward pass reads)."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((10, 6, 8)), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((8, 8)), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((8,)), jnp.float32)

    def loss(x, w1, w2, size):
        fn = lambda x: jnp.tanh(x @ w1 + w2) @ w1.T  # noqa: E731
        return jnp.sum(jnp.sin(subbatch(fn, [x], subbatch_size=size, remat=remat)))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)
    expected, got = grad(x, w1, w2, None), grad(x, w1, w2, 4)  # 4, 4 and a remainder of 2
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-5), got, expected)
