"""dot_product_attention(positions_first=True): query [T, B, N, H], key and value [S, B, K, H],
the output [T, B, N, Hv], as AF2's column-wise modules hold their data. The Pallas kernels read
and write it in place (Plan.columns), the other implementations get batch-first transposes
(base.run): every one matches the float64 reference, forward and gradients, and its own
batch-first call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gated_attention as ga
from gated_attention.attention import base
from tests import reference
from tests.helpers import assert_close, jit_reference

T, S, B, N, H = 40, 24, 3, 2, 16

IMPLEMENTATIONS = [
    pytest.param("xla", id="xla"),
    pytest.param("chunked", id="chunked"),
    pytest.param(ga.PallasAttention(block_q=16, block_k=16, interpret=True), id="pallas"),
    pytest.param(
        ga.PallasAttention(block_q=16, block_k=16, fused_backward=True, interpret=True),
        id="pallas fused",
    ),
    pytest.param(ga.MosaicAttention(bias_grad_programs=2, interpret=True), id="mosaic"),
]


def _problem(dtype):
    rng = np.random.default_rng(0)
    draw = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
    q, k, v = draw(T, B, N, H), draw(S, B, N, H), draw(S, B, N, H)
    bias = draw(1, N, T, S)  # shared by the batch, as AF2's pair bias
    mask = jnp.asarray(rng.random((B, 1, 1, S)) > 0.3).at[1].set(False)  # row 1: no key
    return q, k, v, bias, mask


def _reference(q, k, v, bias, mask):
    swap = lambda x: jnp.swapaxes(x, 0, 1)
    out = reference.dot_product_attention(swap(q), swap(k), swap(v), bias, mask, xp=jnp)
    return swap(out)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_positions_first_against_the_reference_and_batch_first(implementation):
    """float32, a bias shared by the batch, a key mask with a batch row of no key: values and
    the gradients of q, k, v and the bias; the batch-first call on the transposes gives the same
    numbers (the kernels' in-place reads change no arithmetic)."""
    q, k, v, bias, mask = _problem(jnp.float32)
    attend = lambda *a: ga.dot_product_attention(
        *a, mask, implementation=implementation, positions_first=True
    )
    swap = lambda x: jnp.swapaxes(x, 0, 1)
    batch_first = lambda q, k, v, b: swap(
        ga.dot_product_attention(swap(q), swap(k), swap(v), b, mask, implementation=implementation)
    )
    step = lambda fn: jax.jit(lambda ct, *a: (fn(*a), jax.vjp(fn, *a)[1](ct)))
    cotangent = jnp.asarray(np.random.default_rng(1).normal(size=(T, B, N, H)), jnp.float32)
    out, grads = step(attend)(cotangent, q, k, v, bias)
    assert out.shape == (T, B, N, H)
    with jax.enable_x64(True):
        args64 = [np.asarray(x, np.float64) for x in (q, k, v, bias)]
        expected, ref_vjp = jit_reference(lambda *a: jax.vjp(lambda *x: _reference(*x, mask), *a))(
            *args64
        )
        ref_grads = ref_vjp(np.asarray(cotangent, np.float64))
    assert_close(out, expected, reference.tolerance("float32"))
    for g, r in zip(grads, ref_grads, strict=True):
        assert_close(g, r, reference.grad_tolerance("float32", r))
    same, same_grads = step(batch_first)(cotangent, q, k, v, bias)
    assert_close(out, same, dict(rtol=1e-6, atol=1e-6))
    for g, r in zip(grads, same_grads, strict=True):
        assert_close(g, r, dict(rtol=1e-5, atol=1e-5))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS[2:])
def test_the_kernels_read_the_columns_in_place(implementation):
    """The Pallas kernels take positions-first arrays as they lie: no transpose of q, k, v, the
    output or their gradients in the program (the op's XLA implementations transpose)."""
    q, k, v, bias, mask = _problem(jnp.bfloat16)
    assert "positions_first" in implementation.TAKES

    def step(q, k, v, bias, cotangent):
        attend = lambda *a: ga.dot_product_attention(
            *a, mask, implementation=implementation, positions_first=True
        )
        return jax.vjp(attend, q, k, v, bias)[1](cotangent)

    jaxpr = jax.make_jaxpr(step)(q, k, v, bias, q)
    sized = lambda e: any(getattr(o.aval, "size", 0) >= q.size for o in e.outvars)
    moved = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "transpose" and sized(e)]
    assert not moved, moved


def test_an_implementation_without_it_gets_the_transposes():
    """base.run: an implementation whose TAKES lacks positions_first is called batch first, its
    output turned back."""
    seen = []

    class Recording(ga.XlaAttention):
        def __call__(self, query, key, value, *args, options, **kwargs):
            seen.append((query.shape, options.positions_first))
            return super().__call__(query, key, value, *args, options=options, **kwargs)

    q, k, v, bias, mask = _problem(jnp.float32)
    options = base.Options(positions_first=True)
    out = base.run(Recording(), q, k, v, (bias,), mask, scale=H**-0.5, compute_dtype="float32",
                   options=options)  # fmt: skip
    assert seen == [((B, T, N, H), False)] and out.shape == (T, B, N, H)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(query=(T, B, N)), r"positions_first takes query of rank 4 \(\[T\|S, B, N\|K, H\]\), got shape \(40, 3, 2\)"),
        (dict(key=(S, B + 1, N, H)), r"query, key and value must have one batch B"),
        (dict(shard_rows_over="rows"), r"positions_first does not take shard_rows_over"),
        (dict(positions_first="yes"), r"positions_first must be a bool, got 'yes'"),
    ],
)  # fmt: skip
def test_positions_first_errors(kwargs, match):
    shapes = dict(query=(T, B, N, H), key=(S, B, N, H), value=(S, B, N, H))
    arrays = {k: jnp.zeros(kwargs.pop(k, v)) for k, v in shapes.items()}
    with pytest.raises((ValueError, TypeError), match=match):
        ga.dot_product_attention(**arrays, **{"positions_first": True, **kwargs})
