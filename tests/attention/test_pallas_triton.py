"""PallasAttention: the kernels in Pallas's interpreter against the float64 reference (the shared
harness, and lengths spanning several uneven tiles), their lowering to Triton for a CUDA target,
the bias-gradient buffers' size, and dispatch (GPU only unless interpreted; 'auto' on GPU)."""

import dataclasses
import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import gated_attention as ga
from gated_attention.attention import base, gpu_common
from gated_attention.attention.pallas_triton import kernels as pallas_kernels
from gated_attention.attention.pallas_triton import plan as pallas_plan
from gated_attention.attention.pallas_triton import tile_table as pallas_tiles
from gated_attention.core import masking
from tests import implementation_harness as harness
from tests.helpers import device_param, on_device, rand
from tests.implementation_harness import ImplementationTests

# Tiles of 16 (the smallest) and two groups of batch rows for a shared bias's gradient, so the
# harness's 5 rows exercise the grouped accumulation; two rows a forward program in every dtype
# (by default float32 takes one), the last program's second row past the batch.
INTERPRETED = ga.PallasAttention(
    block_q=16, block_k=16, bias_grad_programs=12, rows_per_program=2, interpret=True
)


class TestPallasInterpreted(ImplementationTests):
    """The forward, dk/dv and dq/bias-gradient kernels, interpreted on CPU: the whole contract in
    float32 (the interpreter's compile time is the suite's cost; the mask logic is the same code
    in every dtype), the half dtypes against the reference below."""

    IMPL = INTERPRETED
    DTYPES = ("float32",)


FUSED = dataclasses.replace(INTERPRETED, fused_backward=True)


class TestPallasFusedBackwardInterpreted(ImplementationTests):
    """The one-pass backward (one program per key block, dq from per-key-block partials, the
    bias gradients' group tiles read-modify-written per key block), interpreted: the whole
    contract in float32."""

    IMPL = FUSED
    DTYPES = ("float32",)


@on_device("gpu")
class TestPallasFusedBackwardCompiled(ImplementationTests):
    """The one-pass backward compiled by Triton, in every dtype."""

    IMPL = ga.PallasAttention(fused_backward=True)
    DTYPES = ("float32", "bfloat16", "float16")


@on_device("gpu")
class TestPallasCompiled(ImplementationTests):
    """The kernels compiled by Triton and run on the GPU, with pallas_tiles' tiles: the whole
    contract in every dtype they take, float32 at JAX's default precision (TF32 dots:
    reference.FLOAT32_DOTS' tolerances)."""

    IMPL = ga.PallasAttention()
    DTYPES = ("float32", "bfloat16", "float16")


@on_device("gpu")
def test_compiled_float32_at_highest_precision_is_ieee():
    """precision 'highest' (here jax.default_matmul_precision): IEEE float32 dots in the compiled
    kernels, within float32's own tolerances (as on a CPU), forward and vjp."""
    probs = harness.problem_set(TestPallasCompiled().shape, "float32", calling_conventions=False)
    with jax.default_matmul_precision("highest"):
        results = harness.run(TestPallasCompiled.IMPL, probs.replaced(), scale=probs.scales)
    for name, result in zip(probs.names, results, strict=True):  # IEEE dots, as on a CPU:
        harness.assert_matches(result, probs.expected[name], "float32", name, platform="cpu")


# bfloat16 only (suite time): float16 runs the same kernels, rounded as the float16 harness cases of
# the other implementations check.
@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_half_precision_against_the_reference(dtype):
    """The harness's forms with a bias, forward and vjp, computed in the half dtype itself."""
    harness.assert_forms_match(INTERPRETED, TestPallasInterpreted().shape, dtype)


@pytest.mark.parametrize(
    "impl",
    [
        pytest.param(INTERPRETED, id="interpreted"),
        # 32 queries a forward tile: the fused backward's own (fused_plan) is 16.
        pytest.param(dataclasses.replace(FUSED, block_q=32), id="fused interpreted"),
        device_param(ga.PallasAttention(block_q=16, block_k=16), kind="gpu", id="compiled"),
        device_param(
            ga.PallasAttention(block_q=16, block_k=16, fused_backward=True),
            kind="gpu",
            id="fused compiled",
        ),
    ],
)
def test_several_uneven_tiles_against_the_reference(impl):
    """T = 37 and S = 21 in tiles of 16 (partial last tiles), head dims 8 and 4 padded to 16, a
    shared pair bias, a per-row key bias, a query bias and a head bias (each bias gradient's
    partials over two key blocks), a key mask; float32 forward and every gradient."""
    shape = (3, 37, 21, 2, 8, 4)  # B, T, S, N, H, Hv
    case, case64 = harness.problem(shape, "float32", "shared_bias+key_mask", seed=3)
    rng = np.random.default_rng(5)
    more = [rand(rng, dims, "float32") for dims in ((3, 1, 1, 21), (1, 2, 37, 1), (1, 2, 1, 1))]
    case = case._replace(bias=[case.bias, *(x for x, _ in more)])
    case64 = case64._replace(bias=[case64.bias, *(x64 for _, x64 in more)])
    [result] = harness.run(impl, [case])
    [expected] = harness.reference_run([case64])
    harness.assert_matches(result, expected, "float32", "uneven tiles")


def _specs(dtype=jnp.float32, head_dim=8, batch=3, q_len=20, k_len=24, heads=2):
    sd = jax.ShapeDtypeStruct
    return (
        sd((batch, q_len, heads, head_dim), dtype),
        sd((batch, k_len, heads, head_dim), dtype),
        sd((batch, k_len, heads, 4), dtype),
        sd((1, heads, q_len, k_len), jnp.float32),
        sd((batch, 1, 1, k_len), jnp.bool_),
    )


def _loss(impl, q, k, v, bias, mask):
    out = ga.dot_product_attention(q, k, v, bias, mask, implementation=impl)
    return jnp.sum(out.astype(jnp.float32))


@pytest.mark.parametrize("fused", [False, True], ids=["two-kernel backward", "fused backward"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_lowers_to_triton_for_cuda(dtype, fused):
    """Forward and gradients lower to Triton kernels for a CUDA target on a machine without a GPU
    (Pallas's Triton lowering runs; compiling the kernels needs the GPU)."""
    impl = ga.PallasAttention(fused_backward=fused)

    def loss(q, k, v, bias, mask):  # the implementation itself: the op's check() wants a GPU
        out = impl(q, k, v, (bias,), mask, scale=0.3, compute_dtype=q.dtype)
        return jnp.sum(out.astype(jnp.float32))

    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    # An H100 as the abstract device: jax >= 0.12 asks it for the compute capability to lower for.
    h100 = jax.sharding.AbstractDevice(
        device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu"
    )
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h100)
    with jax.sharding.use_abstract_mesh(mesh):
        traced = jax.jit(grad).trace(*_specs(jnp.dtype(dtype)))
        lowered = traced.lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    backward = ("gated_attention_fused_backward",) if fused else (
        "gated_attention_dkdv", "gated_attention_dq_dbias"
    )  # fmt: skip
    for name in ("gated_attention_forward", *backward):
        assert name in text, name
    assert text.count("__gpu$xla.gpu.triton") == 1 + len(backward)


@pytest.mark.parametrize("fused", [False, True], ids=["two-kernel backward", "fused backward"])
@pytest.mark.parametrize("form", [f for f, (bias, _) in harness.FORMS.items() if bias])
def test_every_bias_form_lowers_to_triton_for_cuda(form, fused):
    """Each of the harness's bias and mask forms (a [1, N, 1, 1] bias too: no load mask, where
    Triton refuses a fill value) lowers, forward and gradients, as the compiled harness runs it.
    The interpreter runs none of Triton's lowering rules."""
    bias_dims, mask_dims = harness.FORMS[form]
    b, t, s, n, h, _ = harness.SHAPE
    qkv = [jax.ShapeDtypeStruct((b, length, n, h), jnp.float32) for length in (t, s, s)]
    bias = jax.ShapeDtypeStruct(harness.dims(bias_dims, harness.SHAPE), jnp.float32)
    mask = None if mask_dims is None else jnp.ones(harness.dims(mask_dims, harness.SHAPE), bool)

    def loss(q, k, v, bias):
        out = ga.PallasAttention(fused_backward=fused)(
            q, k, v, (bias,), mask, scale=0.3, compute_dtype=q.dtype
        )
        return jnp.sum(out)

    h100 = jax.sharding.AbstractDevice(
        device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu"
    )
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h100)
    with jax.sharding.use_abstract_mesh(mesh):
        traced = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(*qkv, bias)
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == (2 if fused else 3)


def test_rows_per_program_changes_no_value():
    """A forward program of 3 batch rows (5 rows: the last group's third past the batch) reads
    the shared bias's tile once for its rows and computes each row exactly as alone: the output
    and the log-sum-exp the backward reads are bit for bit those of 1 row a program (the
    backward's kernels do not depend on it; 2 rows, the harness's, run against the reference)."""
    shape = (5, 37, 21, 2, 8, 8)  # B, T, S, N, H, Hv
    case, _ = harness.problem(shape, "bfloat16", "shared_bias+key_mask", seed=4)
    key_bias, _ = rand(np.random.default_rng(6), (5, 1, 1, 21), "bfloat16")
    runs = []
    for rows in (1, 3):
        impl = ga.PallasAttention(block_q=16, block_k=16, rows_per_program=rows, interpret=True)
        attend = functools.partial(
            ga.dot_product_attention, implementation=impl, return_residual=True
        )
        runs.append(jax.jit(attend)(case.q, case.k, case.v, [case.bias, key_bias], case.mask))
    jax.tree.map(np.testing.assert_array_equal, runs[0], runs[1])


def test_two_rows_a_program_where_a_half_precision_bias_is_shared():
    """The forward's rows per program (Plan.make): 2 by default in half precision at head dims
    up to 32 with a bias shared over the batch; 1 in float32, at head dim 64, without a shared
    bias, or with a causal mask; a given value where a bias is shared."""
    impl = ga.PallasAttention(interpret=True)

    def rows(dtype=jnp.bfloat16, head_dim=32, bias_rows=1, causal=False, given=impl):
        q, k, v, bias, mask = _specs(dtype, head_dim=head_dim, batch=4)
        bias = jax.ShapeDtypeStruct((bias_rows, *bias.shape[1:]), dtype)
        options = base.Options(structure=masking.StructuredMask(is_causal=causal))
        plan = given.plan(q, k, v, (bias,), mask, scale=0.3, compute_dtype=dtype, options=options)
        return plan.rows_per_program

    assert rows() == 2 and rows(jnp.float16, head_dim=8) == 2
    assert rows(jnp.float32) == 1 and rows(head_dim=64) == 1
    assert rows(bias_rows=4) == 1 and rows(causal=True) == 1
    assert rows(jnp.float32, given=ga.PallasAttention(rows_per_program=3, interpret=True)) == 3
    # Compiled, the fast paths are Hopper's: an A100's compiles spilled with them.
    for kind, fast in (("NVIDIA H100 80GB HBM3", True), ("NVIDIA A100-SXM4-80GB", False)):
        device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=1, platform="gpu")
        mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
        q, k, v, bias, mask = _specs(jnp.bfloat16, head_dim=32, batch=4)
        with jax.sharding.use_abstract_mesh(mesh):
            plan = ga.PallasAttention().plan(
                q, k, v, (bias,), mask, scale=0.3, compute_dtype=jnp.bfloat16, platform="gpu"
            )
        assert (plan.base2, plan.rows_per_program) == ((True, 2) if fast else (False, 1)), kind


def test_shared_bias_gradient_is_never_per_row():
    """The backward of a [1, N, T, S] bias with B = 64 rows writes group partials, not a
    [B, N, T, S] array: no value of the backward program has that many elements."""
    q, k, v, bias, mask = _specs(batch=64, q_len=32, k_len=32)
    impl = ga.PallasAttention(block_q=16, block_k=16, bias_grad_programs=8, interpret=True)
    grad = jax.grad(
        lambda b: _loss(
            impl, *(jnp.zeros(x.shape, x.dtype) for x in (q, k, v)), b, jnp.ones(mask.shape, bool)
        )
    )
    jaxpr = jax.make_jaxpr(grad)(jnp.zeros(bias.shape, bias.dtype))
    per_row = 64 * 2 * 32 * 32
    sizes = [
        int(np.prod(var.aval.shape)) for eqn in _pallas_calls(jaxpr.jaxpr) for var in eqn.outvars
    ]
    assert sizes and max(sizes) < per_row, sizes
    # 8 programs wanted, 2 heads x 2 query blocks per row: 2 groups of partials.
    assert 2 * 2 * 32 * 32 in sizes, sizes


def _pallas_calls(jaxpr):
    """The pallas_call equations of a jaxpr, nested ones (custom_vjp, pjit) included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn
            continue
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _pallas_calls(inner)


def test_named_on_cpu_says_to_interpret():
    q, k, v, bias, mask = (jnp.zeros(x.shape, x.dtype) for x in _specs())
    with pytest.raises(NotImplementedError, match="GPU only.*interpret=True"):
        ga.dot_product_attention(q, k, v, bias, mask, implementation="pallas")


@pytest.mark.parametrize(
    "specs, compute_dtype, match",
    [
        (_specs(jnp.float64), jnp.float64, "float32, bfloat16 or float16, got float64"),
        (_specs(head_dim=136), jnp.float32, r"head dims <= 128, got 136 \(query/key\)"),
    ],
)
def test_check_says_why(specs, compute_dtype, match):
    q, k, v, bias, mask = specs
    with pytest.raises(NotImplementedError, match=match):
        INTERPRETED.check(q, k, v, (bias,), mask, compute_dtype=compute_dtype)


def test_the_fused_backward_refuses_more_key_blocks_than_its_partials_take():
    """Over MAX_FUSED_KEY_BLOCKS key blocks (its float32 dq partials, one copy of q each) the
    fused backward is refused, saying which block_k would take the keys; at the bound it runs."""
    from gated_attention.attention.pallas_triton.implementation import MAX_FUSED_KEY_BLOCKS

    keys = 16 * MAX_FUSED_KEY_BLOCKS
    q, k, v, bias, mask = _specs(q_len=20, k_len=keys + 1)
    with pytest.raises(NotImplementedError, match=r"9 blocks of 16 at 129 keys, over its 8 \("
                       r"take fused_backward=False, or block_k >= 17\)"):  # fmt: skip
        FUSED.check(q, k, v, (bias,), mask, compute_dtype=jnp.float32)
    INTERPRETED.check(q, k, v, (bias,), mask, compute_dtype=jnp.float32)  # two kernels: taken
    q, k, v, bias, mask = _specs(q_len=20, k_len=keys)
    FUSED.check(q, k, v, (bias,), mask, compute_dtype=jnp.float32)


def test_auto_takes_it_on_gpu():
    q, k, v, bias, mask = _specs()
    impl, reason = ga.Auto().choose(
        q, k, v, (bias,), mask, compute_dtype=jnp.float32, platform="gpu"
    )
    assert impl.name == "pallas" and "Pallas kernel takes these inputs" in reason
    impl, _ = ga.Auto().choose(q, k, v, (bias,), mask, compute_dtype=jnp.float32, platform="cpu")
    assert impl.name == "xla"
    # What the kernel cannot take goes on down the rules (float64: not cuDNN either).
    q64, k64, v64, *_ = _specs(jnp.float64)
    impl, _ = ga.Auto().choose(q64, k64, v64, (), None, compute_dtype=jnp.float64, platform="gpu")
    assert impl.name == "xla"


def test_float32_dots_follow_jax_matmul_precision():
    """As XLA's float32 dots on a GPU: TF32 by default, three TF32 passes at 'high', IEEE at
    'highest'; the call's precision first, then jax_default_matmul_precision. Half precision
    takes none, and the interpreter (CPU, no TF32) computes every level in float32."""
    f32, bf16 = jnp.float32, jnp.bfloat16
    dot_precision = gpu_common.dot_precision
    assert dot_precision(None, f32, False) == lax.Precision.DEFAULT
    assert dot_precision(lax.Precision.HIGH, f32, False) == lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    assert dot_precision(lax.Precision.HIGHEST, f32, False) == lax.Precision.HIGHEST
    assert dot_precision(lax.Precision.DEFAULT, f32, True) == lax.Precision.HIGHEST
    assert dot_precision(lax.Precision.HIGHEST, bf16, False) is None
    with jax.default_matmul_precision("float32"):
        assert dot_precision(None, f32, False) == lax.Precision.HIGHEST
        assert dot_precision(lax.Precision.DEFAULT, f32, False) == lax.Precision.DEFAULT
    with jax.default_matmul_precision("tensorfloat32"):
        assert dot_precision(None, f32, False) == lax.DotAlgorithmPreset.TF32_TF32_F32_X3


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(block_q=24), "block_q must be a power of two >= 16, got 24"),
        (dict(block_k=8), "block_k must be None or an int >= 16, got 8"),
        (dict(bias_grad_programs=0), "bias_grad_programs must be an int >= 1, got 0"),
        (dict(rows_per_program=0), "rows_per_program must be None or an int >= 1, got 0"),
        (dict(rows_per_program=5), r"rows_per_program must be None or an int in \[1, 4\], got 5"),
        (dict(interpret="yes"), "interpret must be a bool, got 'yes'"),
    ],
)
def test_bad_tuning_is_refused(kwargs, match):
    error = TypeError if "interpret" in kwargs else ValueError  # a wrong type, or a bad value
    with pytest.raises(error, match=match):
        ga.PallasAttention(**kwargs)


def test_tiles_come_from_the_table_and_oversized_ones_are_refused(monkeypatch):
    """Tiles not given come from pallas_tiles' table (by the GPU's shared-memory class, dtype,
    precision, head dim, the op's further arguments and the bias and mask form); tiles whose shared
    memory would pass the GPU's (an A100's where none is known) are refused by check (so 'auto'
    moves on), never a compile error."""
    from gated_attention.core import platforms

    impl = ga.PallasAttention()
    table = pallas_tiles.table()
    assert (
        impl.tiles(jnp.float32, lax.Precision.DEFAULT, 128)
        == table[("large", "float32", "default", 128, False, "both", "full")]
    )
    assert ga.PallasAttention(block_q=32).tiles(jnp.bfloat16, None, 64)[0] == 32
    # Forms differ where one spilled with the heaviest form's tiles; the op's further arguments
    # take the heaviest form's in every form.
    high = lax.Precision.HIGH
    form = pallas_tiles.kernel_form((jnp.zeros((1, 2, 3, 4)),), jnp.zeros((2, 1, 1, 4), bool))
    assert form == ("shared", "key")
    assert impl.tiles(jnp.float32, high, 128, form=form) == (16, 16, 8, 2)
    assert impl.tiles(jnp.float32, high, 128, form=("both", "full")) == (16, 16, 8, 1)
    assert impl.tiles(jnp.float32, high, 128, True, form)[:2] == (16, 16)
    assert pallas_tiles.kernel_form((), jnp.zeros((2, 1, 3, 4), bool)) == ("none", "full")
    # Lengths past the tiles: the plan clamps tiles to the lengths (20 queries: 32 at most).
    q, k, v, bias, mask = _specs(jnp.float32, head_dim=128, q_len=200, k_len=240)
    impl.check(q, k, v, (bias,), mask, compute_dtype=jnp.float32, platform="gpu")
    big = ga.PallasAttention(block_q=128, block_k=128, num_stages=2)
    short = _specs(jnp.float32, head_dim=128)  # the same tiles clamped to 32 x 32 fit
    big.check(*short[:3], (short[3],), short[4], compute_dtype=jnp.float32, platform="gpu")
    with pytest.raises(NotImplementedError, match="shared memory at head dim 128"):
        big.check(q, k, v, (bias,), mask, compute_dtype=jnp.float32, platform="gpu")
    impl, _ = ga.Auto(pallas=big).choose(
        q, k, v, (bias,), mask, compute_dtype=jnp.float32, platform="gpu"
    )
    assert impl.name == "xla"
    # About 119 KB: within an A100's 163 KiB, over a 99 KiB GPU's (an RTX 4090, by its kind),
    # where the table's own tiles are the small class's.
    mid = ga.PallasAttention(block_q=32, block_k=32, num_stages=2)
    mid.check(q, k, v, (bias,), mask, compute_dtype=jnp.float32, platform="gpu")
    gpu = type("Device", (), dict(device_kind="NVIDIA GeForce RTX 4090"))()
    monkeypatch.setattr(platforms, "_gpu", lambda: gpu)
    with pytest.raises(NotImplementedError, match="over the 101,376 a block has on this GPU"):
        mid.check(q, k, v, (bias,), mask, compute_dtype=jnp.float32, platform="gpu")
    small = table[("small", "float32", "default", 128, False, "shared", "full")]
    assert ga.PallasAttention().tiles(jnp.float32, None, 128, form=("shared", "full")) == small


def test_loops_skip_exactly_the_tiles_the_structure_masks_whole():
    """_Tiles.key_blocks (forward, dq) and query_blocks (dk/dv) against the brute-force mask:
    the loops cover every tile with an allowed (query, key) pair (values would be wrong) and
    start and stop at the first and last such tile (the work a causal mask saves)."""
    b, t, s, n, k, h = harness.WIDE
    lengths = {
        key: harness.STRUCTURED[key] for key in ("query_seq_lengths", "key_value_seq_lengths")
    }
    sd = jax.ShapeDtypeStruct
    q, kv = sd((b, t, n, h), jnp.float32), sd((b, s, k, h), jnp.float32)
    impl = ga.PallasAttention(block_q=64, block_k=32, interpret=True)
    for kw in (dict(is_causal=True), dict(local_window_size=(150, 40)), harness.STRUCTURED):
        kw = {**lengths, **kw}
        structure = masking.StructuredMask(kw.get("is_causal", False), kw.get("local_window_size"))
        options = ga.attention.base.Options(structure)
        plan = pallas_plan.Plan.make(impl, q, kv, kv, (), 1.0, jnp.float32, None, options=options)
        tiles = pallas_kernels._Tiles(plan, b, t, s, 0)
        allowed = harness.allowed_by(t, s, kw)[:, 0]
        for row in range(b):
            st = pallas_kernels._Structure(0, *(x[row] for x in lengths.values()))
            per_tile = np.pad(allowed[row], ((0, -t % 64), (0, -s % 32)))
            per_tile = per_tile.reshape(-(-t // 64), 64, -(-s // 32), 32).any(axis=(1, 3))
            for i, tiles_row in enumerate(per_tile):
                lo, hi = (int(x) for x in tiles.key_blocks(st, i))
                live = tiles_row.nonzero()[0]
                expected = (live[0], live[-1] + 1) if live.size else (lo, lo)
                assert (lo, hi) == expected, (kw, row, i)
            for j, tiles_column in enumerate(per_tile.T):
                lo, hi = (int(x) for x in tiles.query_blocks(st, j))
                live = tiles_column.nonzero()[0]
                expected = (live[0], live[-1] + 1) if live.size else (lo, lo)
                assert (lo, hi) == expected, (kw, row, j)


def test_a_jax_without_the_triton_backend_refuses_the_kernel_and_auto_moves_on(monkeypatch):
    """Pallas's Triton backend was deprecated in jax 0.11.0 (for Mosaic GPU): on a JAX without it
    (simulated: its modules fail to import) the kernel is refused with a reason naming the JAX
    version, 'auto' on a GPU moves on to cuDNN or XLA, and importing the library still works."""
    monkeypatch.setitem(sys.modules, "jax.experimental.pallas.triton", None)
    q = jax.ShapeDtypeStruct((2, 64, 4, 32), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((1, 4, 64, 64), jnp.float32)
    with pytest.raises(
        NotImplementedError, match=rf"Triton backend is not in jax {jax.__version__}"
    ):
        ga.PallasAttention().check(
            q, q, q, (bias,), None, compute_dtype=jnp.bfloat16, platform="gpu"
        )
    impl, reason = ga.Auto().choose(
        q, q, q, (bias,), None, compute_dtype=jnp.bfloat16, platform="gpu"
    )
    assert impl.name != "pallas" and "pallas refused: Pallas's Triton backend is not in" in reason
    script = (
        "import sys; sys.modules['jax.experimental.pallas.triton'] = None\n"
        "import gated_attention as ga, jax.numpy as jnp\n"
        "print(ga.dot_product_attention(jnp.ones((1, 8, 2, 4)), jnp.ones((1, 8, 2, 4)), "
        "jnp.ones((1, 8, 2, 4))).shape)"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert "(1, 8, 2, 4)" in out.stdout


def test_check_sizes_shared_memory_on_the_plan_the_call_runs(monkeypatch):
    """check() takes its tiles from the plan __call__ builds (clamped to the lengths, the head
    dims padded as the kernels pad them), so a refusal is decided on what would run."""
    from gated_attention.core import memory

    sizes = []
    size = memory.gpu_shared_memory_bytes
    monkeypatch.setattr(memory, "gpu_shared_memory_bytes", lambda **k: sizes.append(k) or size(**k))
    impl = ga.PallasAttention()
    sd = jax.ShapeDtypeStruct
    q = sd((2, 8, 2, 48), jnp.bfloat16)  # 8 queries: tiles clamp to 16 x 16; head dim 48 pads to 64
    plan = pallas_plan.Plan.make(
        impl, q, q, q, (), 1.0, jnp.bfloat16, None, None, None, ga.attention.base.PLAIN
    )
    impl.check(q, q, q, (), None, compute_dtype=jnp.bfloat16, platform="gpu")
    assert (sizes[-1]["block_q"], sizes[-1]["block_k"]) == (plan.block_q, plan.block_k) == (16, 16)
    assert sizes[-1]["stages"] == plan.num_stages and sizes[-1]["padded_head_dim"] == 64
