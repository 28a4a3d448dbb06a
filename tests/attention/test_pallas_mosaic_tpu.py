"""PallasTpuAttention: the Mosaic kernels interpreted against the float64 reference (the shared
harness in Pallas's generic interpreter; lengths spanning several partial tiles in its TPU
interpreter, which also models TPU memory: scratch starts as NaN), and dispatch (TPU only unless
interpreted; 'auto' on TPU). Compiles for TPU targets: tests/tools/test_targets.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gated_attention as ga
from gated_attention.attention.pallas_mosaic_tpu import kernels as pallas_tpu_kernels
from gated_attention.attention.pallas_mosaic_tpu import plan as pallas_tpu_plan
from gated_attention.core import masking
from tests import implementation_harness as harness
from tests.helpers import device_param, on_device, rand
from tests.implementation_harness import ImplementationTests

INTERPRETED = ga.PallasTpuAttention(interpret=True)
TPU_INTERPRETED = ga.PallasTpuAttention(interpret="tpu")


class TestPallasTpuInterpreted(ImplementationTests):
    """The forward, dk/dv, dq and bias-gradient kernels, interpreted on CPU: the whole contract
    in float32; bfloat16 against the reference below. (The generic interpreter: the TPU one takes
    5x as long here, and the partial-tile cases below run in it.) Two heads: each program
    unrolls its heads (a third costs ~1/3 more compile; tests/attention/test_conformance.py runs four)."""

    IMPL = INTERPRETED
    DTYPES = ("float32",)
    HEADS = 2


@on_device("tpu")
class TestPallasTpuCompiled(ImplementationTests):
    """The kernels compiled by Mosaic and run on the TPU: the whole contract in float32 (its dots
    at JAX's default precision: reference.FLOAT32_DOTS' tolerances) and bfloat16."""

    IMPL = ga.PallasTpuAttention()
    DTYPES = ("float32", "bfloat16")
    HEADS = 2


def test_bfloat16_against_the_reference():
    """The harness's forms with a bias, forward and vjp, computed in bfloat16 itself."""
    harness.assert_forms_match(INTERPRETED, TestPallasTpuInterpreted().shape, "bfloat16")


@pytest.mark.parametrize(
    "impl",
    [
        pytest.param(TPU_INTERPRETED, id="interpreted"),
        device_param(ga.PallasTpuAttention(), kind="tpu", id="compiled"),
    ],
)
@pytest.mark.parametrize(
    "shape, biases, mask",
    [
        # B, T, S, N, H, Hv: 300 queries and 260 keys in tiles of 128 (partial last tiles).
        ((2, 300, 260, 2, 8, 4), ("1NTS", "B11S"), "B11S"),
        ((2, 260, 140, 1, 16, 16), ("BNT1", "1N1S"), "BNTS"),
    ],
)
def test_several_partial_tiles_against_the_reference(shape, biases, mask, impl):
    """Several tiles with partial last ones, head dims padded to the lanes, biases shared over
    the batch and per row, broadcast over queries or keys (their gradients summed over tiles in
    the kernel); float32 forward and every gradient, in the TPU interpreter (an accumulator or
    statistic read before it is written would be NaN)."""
    b, t, s, n, _, _ = shape
    dims = lambda spec: tuple({"B": b, "N": n, "T": t, "S": s, "1": 1}[c] for c in spec)
    case, case64 = harness.problem(shape, "float32", "key_mask", seed=3)
    rng = np.random.default_rng(5)
    pairs = [rand(rng, dims(spec), "float32") for spec in biases]
    mask_value = rng.random(dims(mask)) > 0.2
    mask_value[0, ..., -1] = False  # the last key (a partial tile's) masked in row 0
    case = case._replace(bias=[p[0] for p in pairs], mask=jnp.asarray(mask_value))
    case64 = case64._replace(bias=[p[1] for p in pairs], mask=mask_value)
    [result] = harness.run(impl, [case])
    [expected] = harness.reference_run([case64])
    harness.assert_matches(result, expected, "float32", "partial tiles")


def _specs(dtype=jnp.float32):
    sd = jax.ShapeDtypeStruct
    return (
        sd((3, 20, 2, 8), dtype),
        sd((3, 24, 2, 8), dtype),
        sd((3, 24, 2, 4), dtype),
        sd((1, 2, 20, 24), jnp.float32),
        sd((3, 1, 1, 24), jnp.bool_),
    )


def test_check_refuses_what_it_cannot_take():
    q, k, v, bias, mask = _specs()
    kernel = ga.PallasTpuAttention()
    take = lambda impl, *a, dtype=jnp.float32, platform="tpu": impl.check(
        *a, (bias,), mask, compute_dtype=dtype, platform=platform
    )
    take(kernel, q, k, v)  # the TPU takes it
    with pytest.raises(NotImplementedError, match="runs on TPU only.*'cpu'"):
        take(kernel, q, k, v, platform="cpu")
    take(INTERPRETED, q, k, v, platform="cpu")
    with pytest.raises(NotImplementedError, match="float32 or bfloat16, got float16"):
        take(kernel, q, k, v, dtype=jnp.float16)
    wide = jax.ShapeDtypeStruct((3, 20, 2, 160), jnp.float32)
    with pytest.raises(NotImplementedError, match="head dims <= 128, got 160"):
        take(kernel, wide, wide, v)
    big = ga.PallasTpuAttention(block_q=1024, block_k=1024)
    long_q = jax.ShapeDtypeStruct((1, 4096, 8, 128), jnp.float32)
    with pytest.raises(NotImplementedError, match="VMEM"):
        big.check(long_q, long_q, long_q, (), None, compute_dtype=jnp.float32, platform="tpu")
    with pytest.raises(ValueError, match="block_q must be a multiple of 128, got 200"):
        ga.PallasTpuAttention(block_q=200)
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match=f"interpret must be a bool or 'tpu', got {bad!r}"):
            ga.PallasTpuAttention(interpret=bad)


def test_named_on_cpu_says_why_and_auto_takes_it_on_tpu():
    q, k, v, bias, mask = _specs(jnp.bfloat16)
    x = lambda s: jnp.zeros(s.shape, s.dtype)
    with pytest.raises(NotImplementedError, match="runs on TPU only"):
        ga.dot_product_attention(*map(x, (q, k, v, bias, mask)), implementation="pallas_tpu")
    impl, reason = ga.Auto().choose(
        q, k, v, (bias,), mask, compute_dtype=jnp.bfloat16, platform="tpu"
    )
    assert impl.name == "pallas_tpu", reason
    impl, _ = ga.Auto().choose(q, k, v, (bias,), mask, compute_dtype=jnp.float16, platform="tpu")
    assert impl.name != "pallas_tpu"  # float16 moves on


def test_shared_bias_gradient_is_never_per_row():
    """The bias-gradient kernel's output for a [1, N, T, S] bias is [1, N, ., ., T, S]: summed
    over the batch inside the kernel, no [B, N, T, S] array in the program."""
    q = jax.ShapeDtypeStruct((16, 256, 2, 8), jnp.float32)
    bias = jax.ShapeDtypeStruct((1, 2, 256, 256), jnp.float32)

    def loss(q, bias):
        out = INTERPRETED(q, q, q, (bias,), None, scale=0.3, compute_dtype=jnp.float32)
        return jnp.sum(out)

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=1))(q, bias)
    shapes = [
        v.aval.shape
        for eqn in jaxpr.jaxpr.eqns
        if eqn.primitive.name == "pallas_call"
        for v in eqn.outvars
    ]
    assert shapes, "no pallas_call in the program"
    assert all(np.prod(s) < 16 * 2 * 256 * 256 for s in shapes), shapes
    assert (1, 2, 1, 1, 256, 256) in shapes, shapes


def test_skips_exactly_the_tiles_the_structure_masks_whole():
    """pallas_tpu_kernels.any_allowed against the brute-force mask, tile by tile: no tile with
    an allowed (query, key) pair is skipped (values would be wrong), and every other one is (the
    work)."""
    b, t, s, n, k, h = harness.WIDE
    sd = jax.ShapeDtypeStruct
    q, kv = sd((b, t, n, h), jnp.float32), sd((b, s, k, h), jnp.float32)
    lengths = {
        key: harness.STRUCTURED[key] for key in ("query_seq_lengths", "key_value_seq_lengths")
    }
    for kw in (dict(is_causal=True), dict(local_window_size=(150, 40)), harness.STRUCTURED):
        kw = {**lengths, **kw}
        structure = masking.StructuredMask(kw.get("is_causal", False), kw.get("local_window_size"))
        options = ga.attention.base.Options(structure)
        plan = pallas_tpu_plan.Plan.make(INTERPRETED, q, kv, kv, (), None, 1.0, jnp.float32,
                                         options, None, None)  # fmt: skip
        allowed = harness.allowed_by(t, s, kw)
        skipped = 0
        for row in range(b):
            for i in range(plan.q_blocks):
                for j in range(plan.k_blocks):
                    tile = allowed[row, 0, i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
                    take = pallas_tpu_kernels.any_allowed(
                        plan, i, j, 0, *(x[row] for x in lengths.values())
                    )
                    assert bool(take) == tile.any(), (kw, row, i, j)
                    skipped += not tile.any()
        assert skipped >= 3, kw
