"""MosaicAttention(persistent=True): the forward as a fixed number of programs (one per streaming
multiprocessor, Plan.programs), each looping over the tiles t, t + programs, ... a grid would
launch (attention/pallas_mosaic_gpu/kernels_sm90_forward.py's _tile), the pipeline's slot count
and barrier phases carried from one tile to the next. Interpreted against the float64 reference:
forward and gradients (the backward is the usual one) with a program count that does not divide
the tiles (forced by patching platforms.gpu_core_count: some programs redo the last tile), one
and two consumers and two rows a program; a causal, windowed, grouped-head call equal to the
grid's; the plan's program count and what it refuses. Tiny shapes: the interpreter runs each
program in Python."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gated_attention as ga
from gated_attention.attention.pallas_mosaic_gpu import implementation as mosaic
from gated_attention.attention.pallas_mosaic_gpu import plan as mosaic_plan
from gated_attention.core import platforms
from tests import implementation_harness as harness
from tests import reference
from tests.helpers import assert_close, on_device


def _impl(consumers: int = 1, persistent: bool = True, **kw):
    return ga.MosaicAttention(
        block_k=64, consumer_warpgroups=consumers, persistent=persistent, bias_grad_programs=1,
        interpret=True, **kw,
    )  # fmt: skip


def _plan(impl, case):
    biases = case.bias if isinstance(case.bias, list) else [case.bias]
    return mosaic.Plan.make(
        impl, case.q, case.k, case.v, biases, case.mask, 1.0, case.q.dtype, ga.attention.base.PLAIN
    )


@pytest.mark.parametrize(
    "dtype, consumers, rows, programs, tiles",
    [
        # 1 row x 2 heads x 3 query blocks over 4 programs: two redo the last tile.
        ("float32", 1, 1, 4, 6),
        # 2 query spans of two blocks (the second's second clamped) x 2 heads over 3 programs.
        ("bfloat16", 2, 1, 3, 4),
        # 2 row groups of two rows (the second's second clamped) x 2 heads x 3 blocks over 5.
        ("bfloat16", 1, 2, 5, 12),
    ],
)
def test_persistent_against_the_reference(monkeypatch, dtype, consumers, rows, programs, tiles):
    """T = 130 (3 query blocks), S = 70 (two key blocks, the last partial), 2 heads, AF2's MSA
    row form (a shared bias, a key mask); forward and every gradient."""
    monkeypatch.setattr(platforms, "gpu_core_count", lambda: programs)
    batch = 3 if rows > 1 else 1
    case, case64 = harness.problem((batch, 130, 70, 2, 16, 8), dtype, "shared_bias+key_mask", 13)
    impl = _impl(consumers, rows_per_program=rows)
    plan = _plan(impl, case)
    assert (plan.programs, np.prod(plan.tiles(batch))) == (programs, tiles)
    assert tiles % programs  # some programs get one tile fewer
    [result] = harness.run(impl, [case])
    [expected] = harness.reference_run([case64])
    harness.assert_matches(result, expected, dtype, f"persistent, c{consumers}, r{rows}")


def test_persistent_with_its_producer_in_the_interpreter(monkeypatch):
    """The compiled form's three warpgroups, interpreted eagerly (mosaic_plan.INTERPRET_WARPGROUPS;
    inside a jitted program the interpreter's threads deadlock on 2 cores): 3 programs over 4
    tiles (2 heads x 2 query spans, the second's second block clamped), so two programs redo
    the last; the producer streams each tile's 3 key blocks on through the two slots, the slot
    count and the consumed barrier's phases carried from tile to tile (the second starts on
    slot 1), in bfloat16 with AF2's MSA row form: the output (the backward is the grid's)."""
    monkeypatch.setattr(mosaic_plan, "INTERPRET_WARPGROUPS", 2)
    monkeypatch.setattr(platforms, "gpu_core_count", lambda: 3)
    shape = (1, 192, 192, 2, 16, 16)  # B, T, S, N, H, Hv
    case, case64 = harness.problem(shape, "bfloat16", "shared_bias+key_mask", seed=7)
    impl = _impl(2)
    plan = _plan(impl, case)
    assert (plan.threads, plan.programs, np.prod(plan.tiles(1))) == (3, 3, 4)

    out = ga.dot_product_attention(
        case.q, case.k, case.v, case.bias, case.mask, implementation=impl
    )
    [(expected, _)] = harness.reference_run([case64])
    assert_close(out, expected, reference.tolerance("bfloat16"), "persistent with a producer")


def test_persistent_causal_as_the_grid(monkeypatch):
    """Two consumers, a causal mask with a (64, 0) window at T = S = 192, four query heads on two
    key/value heads, 3 programs over the 8 tiles: each tile's own key blocks and key/value head;
    out and log-sum-exp equal the grid's (the same arithmetic row by row)."""
    monkeypatch.setattr(platforms, "gpu_core_count", lambda: 3)
    consumers = 2
    rng = np.random.default_rng(3)
    draw = lambda heads: jnp.asarray(rng.normal(size=(1, 192, heads, 16)), jnp.float32)  # noqa: E731
    q, k, v = draw(4), draw(2), draw(2)
    kw = dict(is_causal=True, local_window_size=(64, 0), return_residual=True)
    grid = ga.dot_product_attention(q, k, v, implementation=_impl(consumers, False), **kw)
    loop = ga.dot_product_attention(q, k, v, implementation=_impl(consumers), **kw)
    for a, b in zip(grid, loop, strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-6)


def test_the_plan_counts_programs(monkeypatch):
    """One program per streaming multiprocessor (at most one per tile); 0 (the grid) unless
    persistent; the backward's plan the same less the second consumer."""
    sd = lambda b, t: jax.ShapeDtypeStruct((b, t, 8, 32), jnp.bfloat16)  # noqa: E731
    make = lambda impl, b, t: mosaic.Plan.make(  # noqa: E731
        impl, sd(b, t), sd(b, t), sd(b, t), [], None, 1.0, jnp.bfloat16, ga.attention.base.PLAIN
    )
    assert make(_impl(2), 512, 384).programs == platforms.CORE_COUNT_FALLBACK == 132
    assert make(_impl(2), 1, 130).programs == 8 * 2  # fewer tiles than multiprocessors
    assert make(_impl(2, persistent=False), 512, 384).programs == 0
    monkeypatch.setattr(platforms, "gpu_core_count", lambda: 114)
    assert make(_impl(1), 4, 384).programs == 114
    assert make(_impl(1), 4, 384).with_one_consumer().programs == 114


def test_the_core_count_by_device(monkeypatch):
    """A device's core_count, else its kind's (the H100 PCIe's 114), else the H100 SXM's."""
    for device, count in [
        (types.SimpleNamespace(core_count=78, device_kind="NVIDIA H100 80GB HBM3"), 78),
        (types.SimpleNamespace(device_kind="NVIDIA H100 PCIe"), 114),
        (types.SimpleNamespace(device_kind="NVIDIA H200"), 132),
        (types.SimpleNamespace(device_kind="a new GPU"), 132),
        (None, 132),
    ]:
        monkeypatch.setattr(platforms, "_gpu", lambda device=device: device)
        assert platforms.gpu_core_count() == count, device


@pytest.mark.parametrize("value", [1, "yes", None])
def test_a_bad_persistent_is_refused(value):
    with pytest.raises(TypeError, match=f"persistent must be a bool, got {value!r}"):
        ga.MosaicAttention(persistent=value)


@on_device("gpu")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("consumers", [1, 2])
def test_persistent_compiled_against_the_reference(dtype, consumers):
    """The compiled persistent forward (one program per multiprocessor, more tiles than
    programs: each program loops, its producer loading the next tile's k and v while the
    consumers store the last) at AF2's MSA row form with uneven lengths: forward and every
    gradient against the reference."""
    shape = (48, 200, 150, 4, 32, 32)  # B, T, S, N, H, Hv: 192 (96) tiles a grid would launch
    case, case64 = harness.problem(shape, dtype, "shared_bias+key_mask", seed=21)
    impl = ga.MosaicAttention(consumer_warpgroups=consumers, persistent=True)
    [result] = harness.run(impl, [case])
    [expected] = harness.reference_run([case64])
    harness.assert_matches(result, expected, dtype, f"persistent compiled, c{consumers}")
