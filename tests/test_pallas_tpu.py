"""PallasTpuAttention: the Mosaic kernels interpreted against the float64 reference (the shared
harness in Pallas's generic interpreter; lengths spanning several partial tiles in its TPU
interpreter, which also models TPU memory: scratch starts as NaN), and dispatch (TPU only unless
interpreted; 'auto' on TPU). Compiles for TPU targets: tests/test_targets.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gated_attention as ga
from gated_attention import masking, pallas_tpu
from tests import implementation_harness as harness
from tests import reference
from tests.helpers import assert_close, rand
from tests.implementation_harness import ImplementationTests

INTERPRETED = ga.PallasTpuAttention(interpret=True)
TPU_INTERPRETED = ga.PallasTpuAttention(interpret="tpu")


class TestPallasTpuInterpreted(ImplementationTests):
    """The forward, dk/dv, dq and bias-gradient kernels, interpreted on CPU: the whole contract
    in float32; bfloat16 against the reference below. (The generic interpreter: the TPU one takes
    5x as long here, and the partial-tile cases below run in it.)"""

    IMPL = INTERPRETED
    DTYPES = ("float32",)


def test_bfloat16_against_the_reference():
    """Every bias/mask form of the harness, forward and vjp, computed in bfloat16 itself."""
    shape = TestPallasTpuInterpreted().shape
    probs = harness.problem_set(shape, "bfloat16", calling_conventions=False)
    results = harness.run(INTERPRETED, probs.replaced(), scale=probs.scales)
    for name, result in zip(probs.names, results, strict=True):
        harness.check_types(result, probs.cases[name], name)
        harness.assert_matches(result, probs.expected[name], "bfloat16", name)


@pytest.mark.parametrize(
    "shape, biases, mask",
    [
        # B, T, S, N, H, Hv: 300 queries and 260 keys in tiles of 128 (partial last tiles).
        ((3, 300, 260, 2, 8, 4), ("1NTS", "B11S"), "B11S"),
        ((2, 260, 140, 1, 16, 16), ("BNT1", "1N1S"), "BNTS"),
    ],
)
def test_several_partial_tiles_against_the_reference(shape, biases, mask):
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
    [result] = harness.run(TPU_INTERPRETED, [case])
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


# B, T, S, N (query heads), K (key/value heads), H: three query and key tiles of 128, partial.
WIDE = (2, 300, 290, 2, 1, 16)
STRUCTURED = dict(
    is_causal=True,
    local_window_size=(150, 40),
    query_seq_lengths=np.array([300, 170], np.int32),
    key_value_seq_lengths=np.array([290, 100], np.int32),
    logits_soft_cap=3.0,
)


def _allowed(t, s, kw):
    """bool [B, 1, T, S]: the causal, window and length masks of kw, brute force."""
    i, j = np.arange(t)[:, None], np.arange(s)[None, :]
    ok = np.ones((t, s), bool)
    if kw.get("is_causal"):
        ok &= j <= i
    if kw.get("local_window_size"):
        left, right = kw["local_window_size"]
        ok &= (j >= i - left) & (j <= i + right)
    q_ok = i < kw["query_seq_lengths"][:, None, None]
    return (ok & q_ok & (j < kw["key_value_seq_lengths"][:, None, None]))[:, None]


def test_grouped_structured_and_capped_over_several_tiles():
    """Grouped-query attention (2 query heads over 1), causal + window + both lengths, soft cap,
    a shared bias and a key mask, over 3 x 3 tiles (some skipped whole, some partial): forward,
    residual and every gradient against the float64 reference given the equivalent mask."""
    b, t, s, n, k, h = WIDE
    rng = np.random.default_rng(11)
    q, q64 = rand(rng, (b, t, n, h), "float32")
    key, k64 = rand(rng, (b, s, k, h), "float32")
    v, v64 = rand(rng, (b, s, k, h), "float32")
    bias, bias64 = rand(rng, (1, n, t, s), "float32")
    cot, cot64 = rand(rng, (b, t, n, h), "float32")
    key_mask = rng.random((b, 1, 1, s)) > 0.1
    allowed = _allowed(t, s, STRUCTURED) & key_mask
    valid = (np.arange(t)[None] < STRUCTURED["query_seq_lengths"][:, None])[..., None, None]

    def ours(q, key, v, bias):
        return ga.dot_product_attention(
            q, key, v, bias, jnp.asarray(key_mask), implementation=INTERPRETED,
            return_residual=True, **STRUCTURED,
        )  # fmt: skip

    def expected(q, key, v, bias):
        out = reference.dot_product_attention(
            q, key, v, bias, jnp.asarray(allowed), soft_cap=3.0, xp=jnp
        )
        return jnp.where(jnp.asarray(valid), out, 0.0)

    out, vjp, res = jax.vjp(ours, q, key, v, bias, has_aux=True)
    want, want_vjp = jax.vjp(expected, q64, k64, v64, bias64)
    assert_close(out, want, reference.tolerance("float32"))
    has_key = np.swapaxes(allowed.any(axis=-1), 1, 2)  # [B, T, 1]
    assert has_key.sum() < has_key.size  # rows beyond the lengths have none
    logits = np.einsum("btnh,bsnh->bnts", q64, np.repeat(k64, n // k, axis=2)) / np.sqrt(h) + bias64
    logits = np.where(allowed, 3.0 * np.tanh(logits / 3.0), -np.inf)
    with np.errstate(divide="ignore"):
        lse = np.log(np.exp(logits).sum(-1)).transpose(0, 2, 1)  # [B, T, N]
    live = np.broadcast_to(has_key, lse.shape)
    assert_close(np.asarray(res)[live], lse[live], reference.tolerance("float32"))
    for name, g, e in zip(("dq", "dk", "dv", "dbias"), vjp(cot), want_vjp(cot64), strict=True):
        e = np.asarray(e)
        assert_close(g, e, reference.grad_tolerance("float32", e), err_msg=name)


def test_skips_exactly_the_tiles_the_structure_masks_whole():
    """pallas_tpu.any_allowed against the brute-force mask, tile by tile: no tile with an allowed
    (query, key) pair is skipped (values would be wrong), and every other one is (the work)."""
    b, t, s, n, k, h = WIDE
    sd = jax.ShapeDtypeStruct
    q, kv = sd((b, t, n, h), jnp.float32), sd((b, s, k, h), jnp.float32)
    lengths = {key: STRUCTURED[key] for key in ("query_seq_lengths", "key_value_seq_lengths")}
    for kw in (dict(is_causal=True), dict(local_window_size=(150, 40)), STRUCTURED):
        kw = {**lengths, **kw}
        structure = masking.Structure(kw.get("is_causal", False), kw.get("local_window_size"))
        options = ga.base.Options(structure)
        plan = pallas_tpu._Plan.make(INTERPRETED, q, kv, kv, (), None, 1.0, jnp.float32,
                                     options, None, None)  # fmt: skip
        allowed = _allowed(t, s, kw)
        skipped = 0
        for row in range(b):
            for i in range(plan.q_blocks):
                for j in range(plan.k_blocks):
                    tile = allowed[row, 0, i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
                    take = pallas_tpu.any_allowed(
                        plan, i, j, 0, *(x[row] for x in lengths.values())
                    )
                    assert bool(take) == tile.any(), (kw, row, i, j)
                    skipped += not tile.any()
        assert skipped >= 3, kw
