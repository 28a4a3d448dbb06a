"""The peers (gated_attention/attention/peers.py): tokamax's and ColabFold's kernels behind this
library's contract. Against the float64 reference where they run here (tokamax's 'xla' and
'xla_chunked' on CPU, where tokamax is installed: the Python 3.12 stack; ColabFold's adaptation
through its own XLA reference, path='xla': its Triton kernels use PTX inline assembly, which
Pallas's interpreter cannot run); what each refuses and why; 'auto' taking one only from the
tuning table, and ours where it is absent. Deviceless compiles: tests/attention/test_peer_compiles.py."""

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gated_attention as ga
from gated_attention.attention import base, candidates, dispatch, peers, per_mode, tuning
from gated_attention.core import masking
from tests import implementation_harness as harness
from tests.helpers import jit_reference
from tests.implementation_harness import ImplementationTests

H100 = "NVIDIA H100 80GB HBM3"
HAS_TOKAMAX = importlib.util.find_spec("tokamax") is not None
needs_tokamax = pytest.mark.skipif(
    not HAS_TOKAMAX, reason="tokamax is not installed (Python >= 3.12: the .venv312 stack)"
)


@needs_tokamax
class TestTokamaxXla(ImplementationTests):
    """tokamax's dense XLA attention behind the contract: every form, the mask contract."""

    IMPL = ga.TokamaxAttention("xla")
    DTYPES = ("float32", "bfloat16")


@needs_tokamax
def test_tokamax_xla_chunked_against_the_reference():
    """Every form and calling convention, forward and vjp, compiled at XLA's own level: at this
    process's -O0 (conftest.py) XLA:CPU computes the unbatched case's dq as inf (finite at the
    default level, as the reference's own -O0 miscompile, helpers.REFERENCE_COMPILE)."""
    probs = harness.problem_set(harness.SHAPE, "float32", calling_conventions=True)
    impl = ga.TokamaxAttention("xla_chunked")
    run = jit_reference(
        lambda cases: [
            harness._fwd_vjp(impl, c, s, "input") for c, s in zip(cases, probs.scales, strict=True)
        ]
    )
    for name, result in zip(probs.names, run(tuple(probs.replaced())), strict=True):
        harness.check_types(result, probs.cases[name], name)
        harness.assert_matches(result, probs.expected[name], "float32", name)


@needs_tokamax
def test_tokamax_takes_the_structured_masks_and_the_soft_cap():
    """Causal, window, lengths and soft cap reach tokamax's own arguments (the reference applies
    them as masks and a cap): T != S, grouped heads."""
    rng = np.random.default_rng(3)
    b, t, s, n, k, h = 2, 9, 11, 4, 2, 8
    q, k_, v = (rng.normal(size=shape).astype(np.float32) for shape in
                ((b, t, n, h), (b, s, k, h), (b, s, k, h)))  # fmt: skip
    kw = dict(is_causal=True, local_window_size=(3, 0), logits_soft_cap=2.0,
              key_value_seq_lengths=jnp.array([11, 6]), query_seq_lengths=jnp.array([9, 4]))  # fmt: skip
    got = ga.dot_product_attention(q, k_, v, **kw, implementation="tokamax_xla")
    ours = ga.dot_product_attention(q, k_, v, **kw, implementation="xla")
    np.testing.assert_allclose(np.asarray(got), np.asarray(ours), rtol=2e-5, atol=2e-5)
    assert np.abs(np.asarray(ours)).max() > 0.1


# ColabFold's forms: its nonbatched bias (shared over the batch) and a key mask.
COLABFOLD_FORMS = ("plain", "key_mask", "shared_bias+key_mask", "head_bias+shared_mask")
SHAPE = (5, 7, 7, 3, 4, 4)  # B, T, S, N, H, Hv: self-attention (the packed kernel), Hv == H


def _colabfold_forms(impl, dtype="float32", garbage=None):
    """ColabFold's forms against the float64 reference (head_bias+shared_mask with a key mask
    instead of its [1, 1, T, S] one); with `garbage` the key-masked form again with a fully
    masked batch row and that garbage in its dead inputs, which must not leak."""
    cases, cases64 = [], []
    for form in COLABFOLD_FORMS:
        mask = harness.garbage_masks(SHAPE)["shared_bias+key_mask"] if "mask" in form else None
        case, case64 = harness.problem(SHAPE, dtype, form, mask=mask)
        cases.append(case)
        cases64.append(case64)
    results = harness.run(impl, cases)
    expected = harness.reference_run(cases64)
    for form, result, exp, case in zip(COLABFOLD_FORMS, results, expected, cases, strict=True):
        harness.check_types(result, case, form)
        harness.assert_matches(result, exp, dtype, form)
    clean = cases[2]
    out = np.asarray(results[2][0])  # batch 1 sees no key: the mean of its values
    np.testing.assert_allclose(out[1], np.broadcast_to(np.asarray(clean.v)[1].mean(0), out[1].shape),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    dirty = harness.with_garbage(clean, SHAPE, np.nan)
    [dirty_result] = harness.run(impl, [dirty])
    harness.assert_no_leak(dirty_result, results[2], clean, SHAPE, dtype, "nan garbage")


@pytest.mark.parametrize("packed", [False, True])
def test_colabfold_adaptation_against_the_reference(packed):
    _colabfold_forms(ga.ColabFoldAttention(packed=packed, path="xla"))


def test_colabfold_packed_reads_the_packed_array_and_returns_one_gradient():
    """packed_dot_product_attention's [B, T, 4, N, H] (slot 3 the caller's): the output and the
    gradient of the whole array as ours give them, slot 3's zero."""
    rng = np.random.default_rng(5)
    qkv = rng.normal(size=(2, 8, 4, 2, 8)).astype(np.float32)
    bias = rng.normal(size=(1, 2, 8, 8)).astype(np.float32)
    mask = np.ones((2, 1, 1, 8), bool)
    mask[0, ..., :3] = False

    def loss(impl, qkv, bias):
        out = ga.packed_dot_product_attention(qkv, bias, mask, implementation=impl)
        return (out * jnp.arange(out.size).reshape(out.shape) / out.size).sum()

    impl = ga.ColabFoldAttention(packed=True, path="xla")
    got = jax.value_and_grad(lambda *a: loss(impl, *a), argnums=(0, 1))(qkv, bias)
    ours = jax.value_and_grad(lambda *a: loss("xla", *a), argnums=(0, 1))(qkv, bias)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ours), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)
    assert np.all(np.asarray(got[1][0])[:, :, 3] == 0)


def _spec(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


B, T, S, N, H = 2, 16, 16, 2, 16
Q, KV = _spec((B, T, N, H)), _spec((B, S, N, H))
SHARED, KEY_MASK = _spec((1, N, T, S)), _spec((B, 1, 1, S), jnp.bool_)


def _plan(impl, q=Q, k=KV, v=KV, biases=(SHARED,), mask=KEY_MASK, platform="gpu", **kw):
    dtype = kw.pop("dtype", q.dtype)
    return impl.plan(
        q, k, v, biases, mask, scale=0.25, compute_dtype=dtype, platform=platform, **kw
    )


@pytest.mark.parametrize("impl", [ga.ColabFoldAttention(), ga.ColabFoldAttention(packed=True)])
@pytest.mark.parametrize(
    "change, match",
    [
        (dict(platform="cpu"), r"runs on GPU only, the program is for 'cpu'"),
        (dict(dtype=jnp.float32), r"takes float16 or bfloat16, got float32"),
        (dict(biases=(_spec((B, N, T, S)),)), r"bias shared over the batch .*got \[\(2, 2, 16"),
        (dict(mask=_spec((B, 1, T, S), jnp.bool_)), r"key mask \[B\|1, 1, 1, S\|1\] only, got"),
        (dict(v=_spec((B, S, N, 8))), r"equal key and value head dims, got 16 and 8"),
        (dict(k=_spec((B, S, 1, H)), v=_spec((B, S, 1, H))), r"grouped-query attention"),
        (dict(options=base.Options(return_residual=True)), r"return_residual"),
        (dict(options=base.Options(structure=masking.StructuredMask(is_causal=True))), "causal"),
    ],
)
def test_colabfold_refuses_what_it_does_not_take(impl, change, match):
    assert _plan(impl) is None  # bfloat16, a shared bias and a key mask on a GPU: taken
    with pytest.raises(NotImplementedError, match=match):
        _plan(impl, **change)


def test_colabfold_packed_is_self_attention_and_needs_sm80(monkeypatch):
    k = _spec((B, 8, N, H))
    with pytest.raises(NotImplementedError, match=r"self-attention \(T == S\), got T=16, S=8"):
        _plan(ga.ColabFoldAttention(packed=True), k=k, v=k, biases=(), mask=None)
    _plan(ga.ColabFoldAttention(), k=k, v=k, biases=(), mask=None)  # the unpacked one takes it
    monkeypatch.setattr(peers.platforms, "gpu_capability", lambda: (7, 5))
    with pytest.raises(NotImplementedError, match=r"compute capability 8.0 or later, got 7.5"):
        _plan(ga.ColabFoldAttention())
    with pytest.raises(NotImplementedError, match=r"compute capability 8.0 or later, got 7.5"):
        _plan(ga.TokamaxAttention("triton"), dtype=jnp.bfloat16)


@pytest.mark.parametrize("name", ["mosaic", "triton", "cudnn"])
def test_tokamax_gpu_kernels_refuse_other_platforms(name):
    with pytest.raises(NotImplementedError, match=r"runs on GPU only, the program is for 'tpu'"):
        _plan(ga.TokamaxAttention(name), platform="tpu")


def test_tokamax_refuses_what_it_does_not_take(cudnn_loadable):
    impl = ga.TokamaxAttention("xla")
    for options, match in (
        (base.Options(return_residual=True), "return_residual"),
        (base.Options(structure=masking.StructuredMask(q_offset=jnp.int32(4))), "query offset"),
    ):
        with pytest.raises(NotImplementedError, match=match):
            _plan(impl, options=options)
    with pytest.raises(
        NotImplementedError, match=r"computes in float32, float16, bfloat16, got fl"
    ):
        _plan(impl, dtype=jnp.float64)
    cudnn = ga.TokamaxAttention("cudnn")
    for change, match in (
        (dict(dtype=jnp.float32), r"takes float16 or bfloat16, got float32"),
        (dict(q=_spec((B, T, N, 12)), k=_spec((B, S, N, 12)), v=_spec((B, S, N, 12))),
         r"multiple of 8 and <= 128, got 12"),
        (dict(v=_spec((B, S, N, 8))), r"equal key and value head dims, got 16 and 8"),
    ):  # fmt: skip
        with pytest.raises(NotImplementedError, match=match):
            _plan(cudnn, **change)


def _absent(monkeypatch, *packages):
    """Each of `packages` fails to import, as where it is not installed."""
    real = importlib.import_module

    def import_module(name, *args):
        if name.split(".")[0] in packages:
            raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}")
        return real(name, *args)

    monkeypatch.setattr(peers.importlib, "import_module", import_module)


def test_a_peer_that_is_not_installed_is_refused_with_the_reason(monkeypatch):
    _absent(monkeypatch, "tokamax", "colabfold_kernels")
    for impl, match in (
        (ga.TokamaxAttention("xla"), r"tokamax's 'xla' attention: tokamax is not installed"),
        (ga.TokamaxAttention("triton"), r"tokamax is not installed \(No module named 'tokamax'"),
        (ga.ColabFoldAttention(), r"ColabFold's kernel: colabfold-kernels is not installed"),
        (ga.ColabFoldAttention(packed=True, path="xla"), r"colabfold-kernels is not installed"),
    ):
        with pytest.raises(NotImplementedError, match=match):
            _plan(impl, platform="gpu")
    x = jnp.ones((B, T, N, H), jnp.float32)
    with pytest.raises(NotImplementedError, match=r"implementation='tokamax_xla' cannot take"):
        ga.dot_product_attention(x, x, x, implementation="tokamax_xla")


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: ga.TokamaxAttention("pallas"), ValueError,
         r"implementation must be one of \('mosaic', 'triton', 'cudnn', 'xla_chunked', 'xla'\), "
         r"got 'pallas'"),
        (lambda: ga.ColabFoldAttention(packed=1), TypeError, r"packed must be a bool, got 1"),
        (lambda: ga.ColabFoldAttention(path="cuda"), ValueError,
         r"path must be one of \('pallas', 'xla'\), got 'cuda'"),
        (lambda: ga.Auto(peers=[ga.TokamaxAttention()]), TypeError,
         r"peers must be None or a tuple of implementation instances .*got \["),
        (lambda: ga.Auto(peers=("tokamax_xla",)), TypeError, r"got \('tokamax_xla',\)"),
    ],
)  # fmt: skip
def test_bad_arguments_are_refused(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_importing_gated_attention_imports_no_peer():
    import subprocess
    import sys

    code = "import sys, gated_attention; print('tokamax' in sys.modules, 'colabfold_kernels' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"], out.stderr[-2000:]


def test_the_registry_names_the_peers_as_the_device_benchmark_does():
    from gated_attention_tools import device_benchmark

    assert dispatch.PEERS == (
        "tokamax_mosaic", "tokamax_triton", "tokamax_cudnn", "tokamax_xla_chunked", "tokamax_xla",
        "colabfold", "colabfold_packed",
    )  # fmt: skip
    for name in dispatch.PEERS:
        assert ga.IMPLEMENTATIONS[name].name == name
    tokamax_variants = {v for v in device_benchmark.OP_VARIANTS if v.startswith("tokamax_")}
    assert tokamax_variants <= set(dispatch.PEERS)


# ------------------------------------------------------------------------------------------------
# 'auto': a peer only from the table
# ------------------------------------------------------------------------------------------------


def _on(device_kind):
    gpu = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=1, platform="gpu")
    return jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((1,), ("x",), abstract_device=gpu)
    )


def _choose(auto=None, dtype=jnp.bfloat16, head_dim=32):
    q = _spec((2, 96, 4, head_dim), dtype)
    bias, mask = _spec((1, 4, 96, 96), dtype), _spec((2, 1, 1, 96), jnp.bool_)
    return (auto or ga.Auto()).choose(q, q, q, (bias,), mask, compute_dtype=dtype, platform="gpu")


def test_the_committed_table_and_auto_s_rules_never_take_a_peer(cudnn_loadable):
    named = {e["implementation"] for entries in tuning.table().values() for e in entries}
    assert not named & set(dispatch.PEERS), named
    for device in (H100, "NVIDIA A100-SXM4-80GB", "NVIDIA H200"):
        for dtype in (jnp.bfloat16, jnp.float32, jnp.float16):
            for head_dim in (8, 32, 64):
                with _on(device):
                    impl, reason = _choose(dtype=dtype, head_dim=head_dim)
                members = (impl.inference, impl.training) if isinstance(impl, ga.Implementation) \
                    and hasattr(impl, "inference") else (impl,)  # fmt: skip
                assert not {m.name for m in members} & set(dispatch.PEERS), reason


def _table(monkeypatch, forward, training):
    """tuning.json with H100 entries naming `forward` and `training` (bfloat16, head dim 32)."""
    entries = [
        dict(dtype="bfloat16", mode=mode, long=False, max_head_dim=32, bias="shared",
             implementation=name, candidate=name, options={}, measured="a test's")
        for mode, name in (("forward", forward), ("training", training))
    ]  # fmt: skip
    monkeypatch.setattr(tuning, "table", lambda: {"H100": entries})


def test_auto_takes_a_peer_the_table_names_per_mode_and_ours_where_it_is_absent(monkeypatch):
    _table(monkeypatch, "colabfold", "mosaic")
    with _on(H100):
        impl, reason = _choose()
    assert isinstance(impl, per_mode.PerMode), reason
    assert (impl.inference, impl.training) == (ga.ColabFoldAttention(), ga.MosaicAttention())
    assert reason.startswith(f"measured fastest on {H100}: colabfold for inference, mosaic for")
    _table(monkeypatch, "colabfold_packed", "colabfold_packed")
    with _on(H100):
        assert _choose()[0] == ga.ColabFoldAttention(packed=True)
        assert _choose(ga.Auto(peers=()))[0].name == "mosaic"  # no peers: the rules
    _absent(monkeypatch, "colabfold_kernels", "tokamax")
    for forward, training in (("colabfold", "mosaic"), ("tokamax_triton", "tokamax_triton")):
        _table(monkeypatch, forward, training)
        with _on(H100):
            impl, reason = _choose()
        assert impl.name == "mosaic", reason  # the rules: Hopper's Mosaic kernel


def test_a_per_mode_peer_serves_inference_and_ours_the_training_step():
    """PerMode(ColabFold's adaptation, ours): its value where not differentiated, our forward and
    backward in the gradient (both against ours alone)."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.normal(size=(2, 8, 2, 8)).astype(np.float32) for _ in range(3))
    impl = per_mode.PerMode(ga.ColabFoldAttention(path="xla"), ga.XlaAttention())
    f = lambda impl, q: ga.dot_product_attention(q, k, v, implementation=impl).sum()
    np.testing.assert_allclose(f(impl, q), f("xla", q), rtol=1e-5)
    np.testing.assert_allclose(jax.grad(f, 1)(impl, q), jax.grad(f, 1)("xla", q), rtol=1e-5)


def test_the_sweep_lists_the_peers_for_the_h100_and_the_a100():
    for cap in ((9, 0), (8, 0)):
        found = [c.name for c in candidates.for_target(cap, "bfloat16", 32)]
        assert [n for n in found if n in dispatch.PEERS] == list(dispatch.PEERS), (cap, found)
        found32 = [c.name for c in candidates.for_target(cap, "float32", 32)]
        assert [n for n in found32 if n in dispatch.PEERS] == [
            "tokamax_mosaic", "tokamax_triton", "tokamax_xla_chunked", "tokamax_xla"
        ]  # fmt: skip
    # A Turing GPU: no Pallas kernel of tokamax's or ColabFold's; tokamax's XLA paths and cuDNN.
    found = [c.name for c in candidates.for_target((7, 5), "bfloat16", 32)]
    assert [n for n in found if n in dispatch.PEERS] == [
        "tokamax_cudnn", "tokamax_xla_chunked", "tokamax_xla"
    ]  # fmt: skip
    per_row = [c.name for c in candidates.for_target((9, 0), "bfloat16", 32, bias="per_row")]
    assert "colabfold" not in per_row and "tokamax_triton" in per_row
    assert dataclasses.replace(candidates.candidate("tokamax_triton").build()) == (
        ga.TokamaxAttention("triton")
    )
