"""MosaicAttention(consumer_warpgroups=2): two consumer warpgroups a forward program, each 64 of
its 128 query rows, on the K/V slots one producer streams (attention/pallas_mosaic_gpu/kernels_sm90_forward.py),
interpreted against the float64 reference: forward and gradients (the backward is the usual
one, reading the forward's out and log-sum-exp), uneven lengths whose last program's second
block is past the end (clamped: the last block computed twice), biases and masks with and
without a query dim (a tile per consumer, or one for both), a causal mask (the consumers' union
of key blocks), positions-first and packed inputs, the producer and the consumed barrier's two
arrivals (three interpreted warpgroups), and what the plan refuses. Tiny shapes: the interpreter
runs each program in Python."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gated_attention as ga
from gated_attention.attention.pallas_mosaic_gpu import implementation as mosaic
from gated_attention.attention.pallas_mosaic_gpu import plan as mosaic_plan
from tests import implementation_harness as harness
from tests.helpers import on_device, rand


def _impl(consumers: int = 2, **kw):
    return ga.MosaicAttention(
        block_k=64, consumer_warpgroups=consumers, bias_grad_programs=1, interpret=True, **kw
    )


def _plan(impl, case, options=ga.attention.base.PLAIN):
    biases = case.bias if isinstance(case.bias, list) else [case.bias]
    return mosaic.Plan.make(
        impl, case.q, case.k, case.v, biases, case.mask, 1.0, case.q.dtype, options
    )


@pytest.mark.parametrize(
    "dtype, form",
    [("float32", "shared_bias+key_mask"), ("bfloat16", "batched_bias+query_key_mask")],
)
def test_two_consumers_against_the_reference(dtype, form):
    """T = 130 (3 query blocks: the second program's second block clamped to the third), S = 70
    (two key blocks, the last partial); float32 (TF32: each consumer's staging tile) with AF2's
    MSA row form plus a per-row key bias (one tile both consumers read), bfloat16 with a per-row
    pair bias and a query-and-key mask (a tile per consumer); forward and every gradient."""
    shape = (2, 130, 70, 1, 16, 8)  # B, T, S, N, H, Hv
    case, case64 = harness.problem(shape, dtype, form, seed=13)
    if dtype == "float32":
        key_bias, key_bias64 = rand(np.random.default_rng(5), (2, 1, 1, 70), dtype)
        case = case._replace(bias=[case.bias, key_bias])
        case64 = case64._replace(bias=[case64.bias, key_bias64])
    plan = _plan(_impl(), case)
    assert (plan.consumer_warpgroups, plan.parts, plan.q_blocks) == (2, 2, 3)
    [result] = harness.run(_impl(), [case])
    [expected] = harness.reference_run([case64])
    harness.assert_matches(result, expected, dtype, f"two consumers, {form}")


def test_two_consumers_with_their_producer_in_the_interpreter(monkeypatch):
    """The compiled form's three warpgroups, interpreted eagerly (mosaic_plan.INTERPRET_WARPGROUPS;
    inside a jitted program the interpreter's threads deadlock on 2 cores): a producer streaming
    3 key blocks through the two slots, each reused only once both consumers released it (the
    consumed barrier's two arrivals), in bfloat16 with AF2's MSA row form; forward and every
    gradient against the reference."""
    monkeypatch.setattr(mosaic_plan, "INTERPRET_WARPGROUPS", 2)
    shape = (1, 128, 192, 1, 16, 16)  # B, T, S, N, H, Hv
    case, case64 = harness.problem(shape, "bfloat16", "shared_bias+key_mask", seed=7)
    impl = _impl()
    assert _plan(impl, case).threads == 3

    harness.check_eagerly(impl, case, case64, "bfloat16", "two consumers and a producer")


def test_two_consumers_causal_as_one():
    """A causal mask with a (96, 0) window at T = S = 200, two query heads on one key/value head:
    the consumers of a program walk the union of their query blocks' key blocks, logits masking
    each row's own; out and log-sum-exp equal the one-consumer kernel's (the same arithmetic row
    by row)."""
    rng = np.random.default_rng(3)
    draw = lambda heads: jnp.asarray(rng.normal(size=(1, 200, heads, 16)), jnp.float32)  # noqa: E731
    q, k, v = draw(2), draw(1), draw(1)
    kw = dict(is_causal=True, local_window_size=(96, 0), return_residual=True)
    one = ga.dot_product_attention(q, k, v, implementation=_impl(1), **kw)
    two = ga.dot_product_attention(q, k, v, implementation=_impl(2), **kw)
    for a, b in zip(one, two, strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-6)


def test_two_consumers_forward_positions_first_and_packed():
    """bfloat16, T = 192 (3 query blocks: a clamped second block), a shared bias and a key mask
    (row 1 without a key): output and log-sum-exp against the float64 reference, batch first
    from q, k, v and positions first from a packed q/k/v read in place (Plan.columns,
    Plan.packed), in one jitted program."""
    harness.check_forward_batch_first_and_packed(_impl(), b=2, t=192, seed=19, keyless_rows=(1,))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(consumer_warpgroups=3), "consumer_warpgroups must be 1 or 2, got 3"),
        (dict(consumer_warpgroups=True), "consumer_warpgroups must be 1 or 2, got True"),
        (
            dict(consumer_warpgroups=2, rows_per_program=2),
            r"consumer_warpgroups=2 takes rows_per_program None or 1 .*got rows_per_program=2",
        ),
    ],
)
def test_bad_consumers_are_refused(kwargs, match):
    """At construction, and by the plan's own check (Plan.make: plan.check_consumers)."""
    with pytest.raises(ValueError, match=match):
        ga.MosaicAttention(**kwargs)
    with pytest.raises(ValueError, match=match):
        mosaic_plan.check_consumers(kwargs["consumer_warpgroups"], kwargs.get("rows_per_program"))


def test_the_backward_runs_one_consumer():
    """The backward kernels' plan: one consumer, the forward's out/lse layout (q_pad) as is."""
    sd = jax.ShapeDtypeStruct((1, 130, 1, 16), jnp.bfloat16)
    plan = mosaic.Plan.make(
        _impl(), sd, sd, sd, [], None, 1.0, jnp.bfloat16, ga.attention.base.PLAIN
    )
    back = plan.with_one_consumer()
    assert (plan.consumer_warpgroups, back.consumer_warpgroups) == (2, 1)
    assert plan.q_pad == back.q_pad == 192


@on_device("gpu")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("block_k", [64, 128])
def test_two_consumers_compiled_against_the_reference(dtype, block_k):
    """The compiled two-consumer forward (named-barrier ping-pong, setmaxnreg: what the
    interpreter cannot run), each candidate tile, at AF2's MSA row form with uneven lengths (the
    last program's second block clamped): forward and every gradient against the reference. A
    device run checks it before its sweep times the `c2` candidates."""
    shape = (3, 200, 150, 2, 32, 32)  # B, T, S, N, H, Hv
    case, case64 = harness.problem(shape, dtype, "shared_bias+key_mask", seed=21)
    impl = ga.MosaicAttention(block_k=block_k, consumer_warpgroups=2)
    [result] = harness.run(impl, [case])
    [expected] = harness.reference_run([case64])
    harness.assert_matches(result, expected, dtype, f"two consumers compiled, bk{block_k}")
