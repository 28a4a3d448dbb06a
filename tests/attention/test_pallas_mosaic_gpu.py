"""MosaicAttention: the Mosaic GPU kernels in JAX's Mosaic GPU interpreter against the float64
reference (the shared harness, several uneven tiles, the two-warpgroup pipeline), their compile
for an H100 (sm_90a) with ptxas's figures, what check refuses, and dispatch ('auto' takes them on
Hopper only).

The interpreter runs the kernels' TMA copies, barriers, slots and loops; it cannot run wgmma
with a transposed or register operand, register layouts or `plgpu.load`, which mosaic_plan.Ops
replaces by jnp there (the compiled forms are checked by the H100 compile below)."""

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gated_attention as ga
from gated_attention.attention.pallas_mosaic_gpu import implementation as mosaic
from gated_attention.attention.pallas_mosaic_gpu import pipeline as mosaic_tiles
from gated_attention.attention.pallas_mosaic_gpu import plan as mosaic_plan
from gated_attention.core import masking
from tests import implementation_harness as harness
from tests.helpers import device_param, on_device, rand
from tests.implementation_harness import ImplementationTests

# One group of batch rows for a shared bias's gradient (2 heads x 1 query block per row, 2
# programs wanted): the group's 2 rows add into one buffer (uneven groups: the uneven-tile test).
INTERPRETED = ga.MosaicAttention(bias_grad_programs=2, interpret=True)


class TestMosaicInterpreted(ImplementationTests):
    """The forward, dk/dv and dq/bias-gradient kernels, interpreted on CPU: the whole contract
    in float32, the half dtypes against the reference below. 2 rows of 2 heads: the interpreter
    runs each program's every copy and barrier through Python (~10 ms per program), the suite's
    time."""

    IMPL = INTERPRETED
    DTYPES = ("float32",)
    MASK_CHECKS_ALONE = True  # its interpreter's running, not its compile, is the time
    # Run twice, the interpreter (each program in Python, one at a time) gives equal bits by
    # construction: the kernels' determinism is the compiled class's check, and a second run
    # here was a third of this test's ~80 s.
    BITWISE_DETERMINISTIC = False
    BATCH = 2
    HEADS = 2


@on_device("gpu")
class TestMosaicCompiled(ImplementationTests):
    """The kernels compiled by Mosaic GPU and run on a Hopper GPU: the whole contract in every
    dtype they take, float32 at JAX's default precision (TF32 wgmma: reference.FLOAT32_DOTS'
    tolerances)."""

    IMPL = ga.MosaicAttention()
    DTYPES = ("float32", "bfloat16", "float16")


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_half_precision_against_the_reference(dtype):
    """The harness's forms, forward and vjp, computed in the half dtype itself (float16 runs the
    same kernels)."""
    harness.assert_forms_match(INTERPRETED, TestMosaicInterpreted().shape, dtype)


@pytest.mark.parametrize(
    "impl",
    [
        # 2 heads x 3 query blocks per row, 12 programs wanted: groups of rows 0 and 2, and 1.
        pytest.param(ga.MosaicAttention(bias_grad_programs=12, interpret=True), id="interpreted"),
        device_param(ga.MosaicAttention(), kind="gpu", id="compiled"),
    ],
)
def test_several_uneven_tiles_against_the_reference(impl):
    """T = 130 and S = 150 in tiles of 64 (partial last tiles: padding), head dims 8 and 4
    padded, a shared pair bias (its gradient over uneven groups of rows) and a per-row key
    bias, a key mask; float32 forward and every gradient."""
    shape = (3, 130, 150, 2, 8, 4)  # B, T, S, N, H, Hv
    case, case64 = harness.problem(shape, "float32", "shared_bias+key_mask", seed=3)
    key_bias, key_bias64 = rand(np.random.default_rng(5), (3, 1, 1, 150), "float32")
    case = case._replace(bias=[case.bias, key_bias])
    case64 = case64._replace(bias=[case64.bias, key_bias64])
    [result] = harness.run(impl, [case])
    [expected] = harness.reference_run([case64])
    harness.assert_matches(result, expected, "float32", "uneven tiles")


def _rows_impl(rows: int):
    return ga.MosaicAttention(
        block_k=64, rows_per_program=rows, bias_grad_programs=1, interpret=True
    )


def test_rows_per_program_against_the_reference():
    """3 batch rows a forward program reading the shared bias's tile once a key block: B = 5
    (the last group's row 5 clamped to row 4), float32 (TF32's transposed v, the staging tile
    reused row after row), T = 40 and S = 70 (uneven tiles, two key blocks), a shared pair bias
    and a key mask; forward and every gradient against the float64 reference."""
    shape = (5, 40, 70, 1, 16, 8)  # B, T, S, N, H, Hv
    case, case64 = harness.problem(shape, "float32", "shared_bias+key_mask", seed=11)
    impl = _rows_impl(3)
    plan = mosaic.Plan.make(
        impl, case.q, case.k, case.v, [case.bias], case.mask, 1.0, jnp.float32, ga.attention.base.PLAIN
    )  # fmt: skip
    assert plan.rows_per_program == 3
    [result] = harness.run(impl, [case])
    [expected] = harness.reference_run([case64])
    harness.assert_matches(result, expected, "float32", "3 rows a program")


def test_rows_per_program_forward_in_bfloat16_positions_first_and_packed():
    """2 batch rows a program in bfloat16 with B = 5 (a clamped last group), a shared bias and a
    key mask (rows 1 and 4 without a key): output and log-sum-exp (what the unchanged backward
    reads) against the float64 reference, batch first from q, k, v and positions first from a
    packed q/k/v read in place (Plan.columns, Plan.packed), in one jitted program."""
    harness.check_forward_batch_first_and_packed(
        _rows_impl(2), b=5, t=64, seed=17, keyless_rows=(1, 4)
    )


def test_rows_per_program_only_with_a_bias_shared_over_the_batch():
    """Plan.make's rule (Triton's): the rows asked where a bias is shared over the batch and
    every row walks the same key blocks, at most the batch; 1 for a per-row bias alone, with a
    causal mask, or by default."""
    sd = jax.ShapeDtypeStruct
    q = sd((3, 64, 2, 32), jnp.bfloat16)
    shared, per_row = sd((1, 2, 64, 64), jnp.bfloat16), sd((3, 2, 64, 64), jnp.bfloat16)
    base = ga.attention.base

    def rows(impl, biases, options=base.PLAIN):
        plan = mosaic.Plan.make(impl, q, q, q, biases, None, 1.0, jnp.bfloat16, options)
        return plan.rows_per_program

    assert rows(_rows_impl(2), [shared]) == 2
    assert rows(_rows_impl(4), [per_row, shared]) == 3  # the batch
    assert rows(_rows_impl(2), [per_row]) == 1
    assert rows(_rows_impl(2), [shared], base.Options(masking.StructuredMask(True, None))) == 1
    assert rows(INTERPRETED, [shared]) == 1


def test_two_warpgroups_in_the_interpreter(monkeypatch):
    """The compiled pipeline's form, a producer warpgroup streaming tiles into two slots and a
    consumer releasing them, interpreted eagerly (inside a jitted program the interpreter's
    threads deadlock on 2 cores, mosaic_plan.INTERPRET_WARPGROUPS): 3 key blocks per query block
    reuse a slot, in bfloat16 with a per-row bias and a query-and-key mask; forward and every
    gradient against the reference."""
    monkeypatch.setattr(mosaic_plan, "INTERPRET_WARPGROUPS", 2)
    shape = (2, 64, 192, 1, 16, 16)  # B, T, S, N, H, Hv
    case, case64 = harness.problem(shape, "bfloat16", "batched_bias+query_key_mask", seed=7)
    impl = ga.MosaicAttention(block_k=64, interpret=True)
    assert mosaic.Plan.make(
        impl, case.q, case.k, case.v, [case.bias], case.mask, 1.0, jnp.bfloat16, ga.attention.base.PLAIN
    ).warpgroups == 2  # fmt: skip

    harness.check_eagerly(impl, case, case64, "bfloat16", "two warpgroups")


def test_key_loops_skip_exactly_the_tiles_the_structure_masks_whole():
    """key_blocks (forward, dq) and query_blocks (dk/dv) against the brute-force mask, in the
    kernels' tiles of 64 queries x 64 keys (masking's one rule)."""
    b, t, s, n, k, h = harness.WIDE
    lengths = {
        key: harness.STRUCTURED[key] for key in ("query_seq_lengths", "key_value_seq_lengths")
    }
    sd = jax.ShapeDtypeStruct
    q, kv = sd((b, t, n, h), jnp.float32), sd((b, s, k, h), jnp.float32)
    impl = ga.MosaicAttention(block_k=64, interpret=True)
    for kw in (dict(is_causal=True), dict(local_window_size=(150, 40)), harness.STRUCTURED):
        kw = {**lengths, **kw}
        structure = masking.StructuredMask(kw.get("is_causal", False), kw.get("local_window_size"))
        options = ga.attention.base.Options(structure)
        plan = mosaic.Plan.make(impl, q, kv, kv, (), None, 1.0, jnp.float32, options)
        allowed = harness.allowed_by(t, s, kw)[:, 0]
        for row in range(b):
            st = mosaic_tiles.Meta(0, *(x[row] for x in lengths.values()))
            per_tile = np.pad(allowed[row], ((0, -t % 64), (0, -s % 64)))
            per_tile = per_tile.reshape(-(-t // 64), 64, -(-s // 64), 64).any(axis=(1, 3))
            for i, tiles_row in enumerate(per_tile):
                lo, hi = (int(x) for x in mosaic_tiles.key_blocks(plan, st, i))
                live = tiles_row.nonzero()[0]
                assert (lo, hi) == ((live[0], live[-1] + 1) if live.size else (lo, lo)), (kw, i)
            for j, tiles_column in enumerate(per_tile.T):
                lo, hi = (int(x) for x in mosaic_tiles.query_blocks(plan, st, j))
                live = tiles_column.nonzero()[0]
                assert (lo, hi) == ((live[0], live[-1] + 1) if live.size else (lo, lo)), (kw, j)


def _specs(dtype=jnp.bfloat16, head_dim=32, kv_heads=4, mask_heads=1):
    sd = jax.ShapeDtypeStruct
    return (
        sd((2, 96, 4, head_dim), dtype),
        sd((2, 96, kv_heads, head_dim), dtype),
        sd((2, 96, kv_heads, head_dim), dtype),
        sd((1, 4, 96, 96), jnp.float32),
        sd((2, mask_heads, 1, 96), jnp.bool_),
    )


def _on(device_kind: str):
    """An abstract mesh of one GPU of this kind: what a deviceless compile for it sees."""
    gpu = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=1, platform="gpu")
    return jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((1,), ("x",), abstract_device=gpu)
    )


@pytest.mark.parametrize(
    "device_kind, chosen",
    [
        ("NVIDIA H100 80GB HBM3", "pallas (inference), mosaic (training)"),  # tuning.json
        ("NVIDIA H200", "mosaic (inference), mosaic (training)"),  # its sweep's two candidates
        ("NVIDIA A100-SXM4-80GB", "pallas"),
        ("NVIDIA B200", "pallas"),
    ],
)
def test_auto_takes_it_on_hopper_only(device_kind, chosen):
    """wgmma is sm_90a's: 'auto' moves on to the Triton kernel on an A100 (sm_80) or a B200
    (sm_100, tcgen05), saying why; on an H100 or H200, where a device run measured this class,
    what it measured fastest per mode (tuning.json)."""
    q, k, v, bias, mask = _specs()
    with _on(device_kind):
        impl, reason = ga.Auto().choose(
            q, k, v, (bias,), mask, compute_dtype=jnp.bfloat16, platform="gpu"
        )
    assert impl.name == chosen, reason
    if chosen == "pallas":
        assert (
            "mosaic refused: the Mosaic GPU kernel uses Hopper's wgmma: sm_90 GPUs only" in reason
        )


@pytest.mark.parametrize(
    "specs, compute_dtype, options, match",
    [
        (_specs(jnp.float64), jnp.float64, {}, "float32, bfloat16 or float16, got float64"),
        (_specs(head_dim=136), jnp.bfloat16, {}, r"head dims <= 128, got 136"),
        (
            _specs(jnp.float32),
            jnp.float32,
            dict(precision=jax.lax.Precision.HIGHEST),
            "float32 dots as TF32 wgmma .JAX's default precision., the call asks for",
        ),
        (
            _specs(jnp.float32, head_dim=128)[:4] + (None,),
            jnp.float32,
            {},
            "bytes of shared memory",
        ),
        (_specs(head_dim=128), jnp.bfloat16, {}, "head dims <= 64 with a mask or a causal"),
    ],
)
def test_check_says_why(specs, compute_dtype, options, match):
    """What the kernel cannot take it refuses with the reason ('auto' then moves on)."""
    q, k, v, bias, mask = specs
    with _on("NVIDIA H100 80GB HBM3"), pytest.raises(NotImplementedError, match=match):
        ga.MosaicAttention().check(
            q, k, v, (bias,), mask, compute_dtype=compute_dtype, options=ga.attention.base.Options(**options),
            platform="gpu",
        )  # fmt: skip


def test_named_off_a_gpu_says_to_interpret():
    q, k, v, bias, mask = (jnp.zeros(x.shape, x.dtype) for x in _specs(jnp.float32))
    with pytest.raises(NotImplementedError, match="GPU only.*interpret=True"):
        ga.dot_product_attention(q, k, v, bias, mask, implementation="mosaic")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(block_k=96), "block_k must be 64 or 128, got 96"),
        (dict(block_k=32), "block_k must be None or an int >= 64, got 32"),
        (dict(bias_grad_programs=0), "bias_grad_programs must be an int >= 1, got 0"),
        (dict(rows_per_program=0), "rows_per_program must be None or an int >= 1, got 0"),
        (dict(rows_per_program=5), r"rows_per_program must be None or an int in \[1, 4\], got 5"),
        (dict(interpret="yes"), "interpret must be a bool, got 'yes'"),
    ],
)
def test_bad_tuning_is_refused(kwargs, match):
    error = TypeError if "interpret" in kwargs else ValueError
    with pytest.raises(error, match=match):
        ga.MosaicAttention(**kwargs)


def test_without_the_triton_backend_hopper_keeps_its_kernel_and_an_a100_moves_on(
    monkeypatch, cudnn_loadable
):
    """On a JAX without Pallas's Triton backend (simulated: its module fails to import), 'auto'
    still takes the Mosaic kernel on an H100, and on an A100 moves past both kernels with their
    reasons (wgmma's architecture, the missing backend and the JAX version) to cuDNN."""
    monkeypatch.setitem(sys.modules, "jax.experimental.pallas.triton", None)
    q, k, v, bias, mask = _specs()
    choose = functools.partial(
        ga.Auto().choose, q, k, v, (bias,), mask, compute_dtype=jnp.bfloat16, platform="gpu"
    )
    with _on("NVIDIA H100 80GB HBM3"):
        assert choose()[0].name == "mosaic"
    with _on("NVIDIA A100-SXM4-80GB"):
        impl, reason = choose()
    assert impl.name == "cudnn", reason
    assert (
        "mosaic refused: the Mosaic GPU kernel uses Hopper's wgmma: sm_90 GPUs only, this one is sm_80"
        in reason
    )
    assert f"pallas refused: Pallas's Triton backend is not in jax {jax.__version__}" in reason


def test_half_precision_zeroes_dead_rows_in_shared_memory():
    """In half precision the kernels zero queries with no key and keys no query sees as their
    tiles arrive (no copy of q, k, v): NaN and inf there change nothing, forward or backward,
    across several tiles and slots (bfloat16, a query-and-key mask with dead rows and columns,
    grouped heads)."""
    rng = np.random.default_rng(13)
    b, t, s, n, kv, h = 2, 70, 130, 2, 1, 16
    q = rng.normal(size=(b, t, n, h)).astype(np.float32)
    k, v = (rng.normal(size=(b, s, kv, h)).astype(np.float32) for _ in range(2))
    cot = rng.normal(size=(b, t, n, h)).astype(np.float32)
    mask = rng.random((b, 1, t, s)) > 0.3
    mask[:, :, [3, 65], :] = False  # dead queries
    mask[:, :, :, [5, 129]] = False  # dead keys
    dirty = [x.copy() for x in (q, k, v)]
    dirty[0][:, [3, 65]] = [np.nan, np.inf][0]
    dirty[1][:, 5], dirty[2][:, 129] = np.nan, np.inf

    @jax.jit
    def run(q, k, v):
        def attend(q, k, v):
            return ga.dot_product_attention(
                q, k, v, mask=jnp.asarray(mask), implementation=INTERPRETED, compute_dtype="input"
            ).astype(jnp.float32)

        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp(jnp.asarray(cot))

    clean = run(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)))
    garbage = run(*(jnp.asarray(x, jnp.bfloat16) for x in dirty))
    # A row with no key is the uniform average of the values as given (numerics.py): inf there.
    live = np.setdiff1d(np.arange(t), [3, 65])
    pairs = [(garbage[0][:, live], clean[0][:, live])]
    pairs += list(zip(garbage[1], clean[1], strict=True))
    for name, (a, c) in zip(("out", "dq", "dk", "dv"), pairs, strict=True):
        a, c = np.asarray(a, np.float32), np.asarray(c, np.float32)
        assert np.isfinite(a).all(), name
        np.testing.assert_array_equal(a, c, err_msg=name)


def test_named_and_refused_everywhere_says_the_gpus_reason_too():
    """Named, and taken by no platform the program may be compiled for: the error gives the
    GPU's own reason after the host's (here head dim 128 with a mask, on an H100)."""
    from gated_attention.core import platforms

    if "gpu" not in platforms.compilable():
        pytest.skip("no GPU compiler here: the host's reason is the only one")
    q = jax.ShapeDtypeStruct((2, 64, 4, 128), jnp.bfloat16)
    mask = jax.ShapeDtypeStruct((2, 1, 1, 64), jnp.bool_)
    attend = functools.partial(ga.dot_product_attention, implementation="mosaic")
    with _on("NVIDIA H100 80GB HBM3"), pytest.raises(NotImplementedError) as raised:
        jax.eval_shape(lambda q, m: attend(q, q, q, mask=m), q, mask)
    message = str(raised.value)
    assert message.startswith("implementation='mosaic' cannot take these inputs: ")
    assert "; compiled for gpu: " in message and "head dims <= 64 with a mask" in message


def test_check_refuses_on_the_plan_the_call_runs(monkeypatch):
    """check() sizes shared memory on the same plan __call__ builds: with a mask (rows may be
    dead) the live-row scratch is in both (before, check's plan left it out)."""
    made = {}  # compute dtype -> the shared memory of each plan made for it
    make = mosaic.Plan.make.__func__

    def recording(cls, *args, **kwargs):
        plan = make(cls, *args, **kwargs)
        made.setdefault(str(args[7]), set()).add(mosaic.shared_memory_bytes(plan))
        return plan

    monkeypatch.setattr(mosaic.Plan, "make", classmethod(recording))
    q, k, v, bias, mask = _specs()
    impl = ga.MosaicAttention(interpret=True)
    jax.eval_shape(
        lambda q, k, v, b, m: ga.dot_product_attention(q, k, v, b, m, implementation=impl),
        q, k, v, bias, mask,
    )  # fmt: skip
    assert made and all(len(needs) == 1 for needs in made.values()), made  # check's == call's


def test_each_call_plans_once_and_runs_that_plan(monkeypatch):
    """The op asks the implementation for its plan once per platform kind and runs that very
    plan: Plan.make is called once per kind (before, __call__ made its own: twice), and every
    plan the kernels get is one the refusal was decided on."""
    made, ran = [], []
    make = mosaic.Plan.make.__func__
    attention = mosaic._attention

    def recording(cls, *args, **kwargs):
        made.append(make(cls, *args, **kwargs))
        return made[-1]

    def running(plan, *args):
        ran.append(plan)
        return attention(plan, *args)

    monkeypatch.setattr(mosaic.Plan, "make", classmethod(recording))
    monkeypatch.setattr(mosaic, "_attention", running)
    q, k, v, bias, mask = _specs()
    impl = ga.MosaicAttention(interpret=True)
    attend = functools.partial(ga.dot_product_attention, implementation=impl, compute_dtype="input")
    with ga.record_implementation_choices() as record:
        jax.eval_shape(lambda q, k, v, b, m: attend(q, k, v, b, m), q, k, v, bias, mask)
    kinds = len(record[0]["by_platform"])
    assert len(made) == kinds and ran, (len(made), kinds, len(ran))
    assert all(any(r is m for m in made) for r in ran)
    assert all(m.live for m in made)  # bfloat16 with a mask: the live-row scratch planned
