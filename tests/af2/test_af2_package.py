"""AlphaFold 2's own model (the alphafold-colabfold package) with our attention swapped in: the same
parameters give AF2's outputs (float32 relative difference <= 1e-5), for an EvoformerIteration, for
AF2's family modules on our Attention adapter, and for the whole monomer model (model_1 with
templates, extra MSA and recycling), in which no attention module stays AF2's. The training step's
gradients against AF2's are checked per module (tests/tools/test_benchmarking.py's family cell)."""

import collections
import contextlib
import functools
import importlib.util
import re
import threading
import types

import haiku as hk
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

import gated_attention as ga
from gated_attention.af2 import af2_package
from gated_attention_tools import af2_model, family_benchmark
from tests import reference

config = pytest.importorskip("alphafold.model.config", reason="needs alphafold-colabfold")
modules = af2_package.alphafold_modules()
mapping = pytest.importorskip("alphafold.model.mapping")
utils = pytest.importorskip("alphafold.model.utils")

S, R, C_M, C_Z = 6, 10, 32, 16  # MSA rows (AF2's subbatch_size 4: 4 + 2), residues, channels
TOL = 1e-5


def _model_config():
    c = config.model_config("model_1").model
    return c


def _block(is_extra_msa, is_training):
    c = _model_config()

    def block(msa, pair, msa_mask, pair_mask):
        iteration = modules.EvoformerIteration(
            c.embeddings_and_evoformer.evoformer, c.global_config, is_extra_msa=is_extra_msa
        )
        acts, masks = {"msa": msa, "pair": pair}, {"msa": msa_mask, "pair": pair_mask}
        return iteration(acts, masks, is_training=is_training)

    return block


def _inputs():
    rng = np.random.default_rng(0)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    return (
        f32(rng.normal(size=(S, R, C_M))),
        f32(rng.normal(size=(R, R, C_Z))),
        f32(rng.random((S, R)) > 0.2),
        f32(rng.random((R, R)) > 0.2),
    )


def test_evoformer_iteration_inference_matches_af2():
    """The main MSA's block (row, column and triangle attention); the extra MSA's column global
    attention is checked against the package's in tests/tools/test_benchmarking.py's family cell."""
    block = _block(is_extra_msa=False, is_training=False)
    af2, ours = hk.transform(block), hk.transform(af2_package.use_gated_attention()(block))
    args = _inputs()
    params = family_benchmark.random_params(af2, args)
    # Our modules create exactly AF2's parameters: names, shapes and dtypes.
    assert jax.eval_shape(ours.init, jax.random.PRNGKey(0), *args) == jax.eval_shape(
        af2.init, jax.random.PRNGKey(0), *args
    )
    key = jax.random.PRNGKey(1)
    expected = jax.jit(af2.apply)(params, key, *args)
    actual = jax.jit(ours.apply)(params, key, *args)
    assert family_benchmark.relative_diff(actual, expected) <= TOL


def test_swap_is_scoped_and_reentrant():
    originals = {
        name: af2_package.original_class(modules, name) for name in af2_package.REPLACEMENTS
    }
    now = lambda: {name: af2_package.current_class(modules, name) for name in originals}
    swap = af2_package.use_gated_attention()
    with swap as patched:
        assert patched is modules
        assert now() == af2_package.REPLACEMENTS
        with af2_package.use_gated_attention({"TriangleAttention": af2_model.ZeroUpdate}):
            assert now()["TriangleAttention"] is af2_model.ZeroUpdate
            assert now()["MSAColumnAttention"] is ga.MSAColumnAttention
            assert now()["Attention"] is af2_package.AF2Attention
        with swap:  # re-entered
            assert now() == af2_package.REPLACEMENTS
        assert now()["TriangleAttention"] is ga.TriangleAttention
    assert now() == originals
    with af2_package.use_gated_attention({"Attention": af2_package.AF2Attention}):
        assert now()["Attention"] is af2_package.AF2Attention
        assert now()["TriangleAttention"] is originals["TriangleAttention"]
    assert now()["Attention"] is originals["Attention"]
    with pytest.raises(RuntimeError), swap:  # restored when the block raises too
        raise RuntimeError
    assert now() == originals


def _msa_row_attention():
    """AF2's MSA row attention with pair bias (model_1's config) at a tiny size, transformed."""
    from alphafold.model import config as af2_config

    c = af2_config.model_config("model_1").model
    cfg = c.embeddings_and_evoformer.evoformer.msa_row_attention_with_pair_bias

    def fn(msa, mask, pair):
        return modules.MSARowAttentionWithPairBias(cfg, c.global_config)(msa, mask, pair, False)

    args = (jnp.ones((2, 8, 256)), jnp.ones((2, 8)), jnp.ones((8, 8, 128)))
    return hk.transform(fn), args


def test_swap_does_not_reach_another_thread():
    """While one thread is inside the swap, another thread tracing AF2 builds AF2's modules (the
    swap is a thread-local state, not a module attribute)."""
    t, args = _msa_row_attention()
    params = jax.eval_shape(t.init, jax.random.PRNGKey(0), *args)
    entered, traced = threading.Event(), threading.Event()
    calls = collections.Counter()

    def other():
        entered.wait(timeout=60)
        jax.eval_shape(af2_model.counting_calls(t.apply, calls), params, None, *args)
        traced.set()

    thread = threading.Thread(target=other)
    thread.start()
    with af2_package.use_gated_attention():
        entered.set()
        assert traced.wait(timeout=120)
    thread.join()
    af2_calls = af2_model.af2_attention_calls(calls)
    assert set(af2_calls) == {"MSARowAttentionWithPairBias", "Attention"}, calls
    assert not any(cls.__module__.startswith("gated_attention") for cls in calls), calls


def test_a_jitted_function_is_traced_again_on_the_other_side_of_the_swap():
    """jax.jit's cache never serves a trace made on the other side of the swap: a function
    jitted outside and called inside (and the reverse) is traced again, with the attention of
    its side."""
    t, args = _msa_row_attention()
    params = jax.eval_shape(t.init, jax.random.PRNGKey(0), *args)

    for first_inside in (False, True):
        ours = []

        def apply(params, *args, ours=ours):  # a new function: a cache of its own
            with ga.record_implementation_choices() as record:
                out = t.apply(params, None, *args)
            # Our op's calls for the CPU in this trace (0: AF2's attention); where JAX's CUDA
            # plugin is installed the module traces a GPU branch too.
            ours.append(sum(r["platform"] == "cpu" for r in record))
            return out

        jitted = jax.jit(apply)
        sides = (True, False) if first_inside else (False, True)
        for inside in (*sides, sides[0]):  # the last: the first trace, from the cache
            with af2_package.use_gated_attention() if inside else contextlib.nullcontext():
                jitted.lower(params, *args)
        assert ours == [1 if inside else 0 for inside in sides], (first_inside, ours)


def test_a_failed_entry_leaves_no_lock_held(monkeypatch):
    """An ImportError on entering (AF2 not installed) leaves nothing held: a swap in another
    thread enters at once."""

    def missing():
        raise ImportError("no alphafold")

    monkeypatch.setattr(af2_package, "alphafold_modules", missing)
    with pytest.raises(ImportError, match="no alphafold"), af2_package.use_gated_attention():
        pass
    monkeypatch.undo()
    done = threading.Event()

    def other():
        with af2_package.use_gated_attention():
            done.set()

    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    assert done.wait(timeout=30)


def test_swap_rejects_unknown_names_and_targets():
    match = r"replacements names \['InvariantPointAttention'\].*expected keys"
    with pytest.raises(ValueError, match=match):
        af2_package.use_gated_attention({"InvariantPointAttention": ga.Attention})
    not_af2 = types.ModuleType("not_af2")
    swap = af2_package.use_gated_attention(target=not_af2)
    with pytest.raises(AttributeError, match="not_af2 has no"), swap:
        pass
    with af2_package.use_gated_attention():  # the lock was released after the failed entry
        pass


# --------------------------------------------------------------------------------------------------
# The Attention and GlobalAttention adapters, under AF2's own code.


def _both(fn, args, replacements):
    """(ours, AF2's) outputs of fn(*args) with `replacements` swapped in and without, on the same
    random non-zero params, and the module classes the swapped trace called."""
    af2 = hk.transform(fn)
    calls = collections.Counter()
    ours = hk.transform(
        af2_model.counting_calls(af2_package.use_gated_attention(replacements)(fn), calls)
    )
    params = family_benchmark.random_params(af2, args)
    key = jax.random.PRNGKey(0)
    assert jax.eval_shape(ours.init, key, *args) == jax.eval_shape(af2.init, key, *args)
    return jax.jit(ours.apply)(params, key, *args), jax.jit(af2.apply)(params, key, *args), calls


@pytest.mark.parametrize("what", ["msa_row", "triangle_end"])
def test_af2_family_modules_run_on_our_attention_adapter(what):
    """Only Attention swapped: AF2's own family modules ask the adapter for ColabFold's fused
    kernels, get None, and call it with their additive mask bias and pair bias."""
    c = _model_config()
    evo, gc = c.embeddings_and_evoformer.evoformer, c.global_config

    def fn(msa, pair, msa_mask, pair_mask):
        if what == "msa_row":
            m = modules.MSARowAttentionWithPairBias(evo.msa_row_attention_with_pair_bias, gc)
            return m(msa, msa_mask, pair, is_training=False)
        m = modules.TriangleAttention(evo.triangle_attention_ending_node, gc)
        return m(pair, pair_mask, is_training=False)

    actual, expected, calls = _both(fn, _inputs(), {"Attention": af2_package.AF2Attention})
    assert calls[af2_package.AF2Attention] >= 1
    assert not af2_model.af2_attention_calls(calls).get("Attention")
    assert family_benchmark.relative_diff(actual, expected) <= TOL


def test_template_pointwise_attention_matches_af2():
    """The template embedding's call: queries [B, 1, c_z] attend over T templates [B, T, c_t] with
    AF2's additive bias [1, 1, 1, T] (one template masked), through AF2's inference_subbatch."""
    c = _model_config().embeddings_and_evoformer.template
    gc = _model_config().global_config
    rng = np.random.default_rng(1)
    b, t = 36, 4  # 6 x 6 residue pairs; subbatches of 8 and a remainder
    query = jnp.asarray(rng.normal(size=(b, 1, C_Z)), jnp.float32)
    templates = jnp.asarray(rng.normal(size=(b, t, 64)), jnp.float32)
    bias = utils.mask_to_bias(jnp.asarray([1.0, 1.0, 0.0, 1.0])[None, None, None, :], jnp.float32)

    def fn(query, templates, bias):
        attention = modules.Attention(c.attention, gc, query.shape[-1])
        return mapping.inference_subbatch(attention, 8, [query, templates], [bias])

    actual, expected, calls = _both(fn, (query, templates, bias), None)
    assert calls[af2_package.AF2Attention] >= 1 and not af2_model.af2_attention_calls(calls)
    assert actual.shape == expected.shape == (b, 1, C_Z)
    assert family_benchmark.relative_diff(actual, expected) <= TOL


@pytest.mark.parametrize("gating", [True, False])
def test_global_attention_adapter_matches_af2(gating):
    """AF2's GlobalAttention call (q_mask [b, q, 1] float); without gating AF2 returns one row,
    [b, 1, o], and so does the adapter."""
    gc = _model_config().global_config
    cfg = ml_collections.ConfigDict({"num_head": 4, "gating": gating})  # AF2 reads attributes
    q, _, mask, _ = _inputs()  # [s, r, c_m], [s, r]

    def fn(q, mask):
        return modules.GlobalAttention(cfg, gc, q.shape[-1])(q, q, mask[..., None])

    actual, expected, calls = _both(fn, (q, mask), None)
    assert calls[af2_package.AF2GlobalAttention] >= 1
    assert actual.shape == expected.shape == ((S, R, C_M) if gating else (S, 1, C_M))
    assert family_benchmark.relative_diff(actual, expected) <= TOL


def test_attention_adapter_interface():
    """ColabFold's kernel hooks answer None, trim is a stored bool, and a bias of lower rank
    broadcasts over the leading axes as AF2's `logits + bias` does."""
    gc = _model_config().global_config
    cfg = {"num_head": 2, "gating": True}
    act = jnp.asarray(np.random.default_rng(3).normal(size=(2, 3, 8)), jnp.float32)
    bias = utils.mask_to_bias(jnp.asarray([1.0, 0.0, 1.0]), jnp.float32)  # [k]

    def fn(trim):
        attention = af2_package.AF2Attention(cfg, gc, 8, trim=trim)
        assert attention.trim is trim
        assert attention.packed_kernel(act) is None
        assert attention.ln_projection_kernel(act) is None
        return attention(act, act, bias), attention(act, act, bias[None, None, None])

    t = hk.transform(lambda: fn(True))
    params = family_benchmark.random_params(t, ())
    low_rank, full_rank = t.apply(params, None)
    np.testing.assert_array_equal(low_rank, full_rank)
    with pytest.raises(TypeError, match="trim must be a bool, got 1"):
        hk.transform(lambda: fn(1)).init(jax.random.PRNGKey(0))


def test_template_embedding_attention_counted_only_without_the_full_swap():
    """The whole-model check below can fail: the old default (the four family classes only) left
    the template embedding's pointwise attention AF2's, which counting_calls sees."""
    c = _model_config()
    template, gc = c.embeddings_and_evoformer.template, c.global_config
    r, t = 4, 2
    rng = np.random.default_rng(2)
    batch = {
        "template_mask": jnp.ones((t,)),
        "template_aatype": jnp.zeros((t, r), jnp.int32),
        "template_pseudo_beta": jnp.asarray(rng.normal(size=(t, r, 3)), jnp.float32),
        "template_pseudo_beta_mask": jnp.ones((t, r)),
        "template_all_atom_positions": jnp.asarray(rng.normal(size=(t, r, 37, 3)), jnp.float32),
        "template_all_atom_masks": jnp.ones((t, r, 37)),
    }

    def fn(query, batch):
        return modules.TemplateEmbedding(template, gc)(query, batch, jnp.ones((r, r)), False)

    def af2_calls(replacements):
        calls = collections.Counter()
        swapped = af2_package.use_gated_attention(replacements)(fn)
        jax.eval_shape(
            hk.transform(af2_model.counting_calls(swapped, calls)).init,
            jax.random.PRNGKey(0),
            jnp.zeros((r, r, C_Z)),
            batch,
        )
        return af2_model.af2_attention_calls(calls)

    assert set(af2_calls(af2_package.FAMILY)) == {"Attention"}
    assert af2_calls(None) == {}


# --------------------------------------------------------------------------------------------------
# The whole monomer model, as a user runs it (gated_attention_tools/af2_model.py).


@pytest.fixture(scope="module")
def whole_model():
    """model_1 (templates, extra MSA, one recycle) at 16 residues, 8 clusters, 8 extra rows and 2
    templates (padded to max_templates 4: two masked), float32, 1 block per stack instead of
    48 / 4 and 1 structure-module layer instead of 8 (every module of the model; the depth only
    repeats them): AF2's and ours on the same random params, with the module classes each trace
    called."""
    cfg = af2_model.model_config(n_res=16, n_seq=8, n_extra_seq=8, num_recycle=1)
    e = cfg.model.embeddings_and_evoformer
    e.evoformer_num_block = e.extra_msa_stack_num_block = 1
    cfg.model.heads.structure_module.num_layer = 1  # its layers repeat one module: compile time
    raw = af2_model.raw_features(n_res=16, n_seq=16, n_templates=2, seed=0)
    batch = jax.device_put(af2_model.features(cfg, raw, seed=0))
    ts = {v: af2_model.transformed(cfg, v) for v in ("af2", "ours")}
    params = af2_model.random_params(ts["af2"], batch, seed=0)
    outputs, calls = {}, {}
    for v, t in ts.items():
        calls[v] = collections.Counter()
        apply = af2_model.counting_calls(t.apply, calls[v])
        outputs[v] = af2_model.predictor(cfg, apply)(params, batch)
    return batch, outputs, calls, (cfg, params)


def test_whole_model_matches_af2(whole_model):
    """Every output leaf: max|ours - AF2| / max|AF2| <= 1e-5 (float32)."""
    batch, outputs, _, _ = whole_model
    assert np.asarray(batch["template_mask"][0]).tolist() == [1, 1, 0, 0]
    ours = jax.tree_util.tree_flatten_with_path(outputs["ours"])[0]
    af2 = jax.tree_util.tree_flatten_with_path(outputs["af2"])[0]
    assert [p for p, _ in ours] == [p for p, _ in af2]
    assert len(af2) >= 14  # heads, structure, confidences, prev
    for (path, a), (_, b) in zip(ours, af2, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, jax.tree_util.keystr(path)
        assert np.isfinite(b).all(), jax.tree_util.keystr(path)
        diff = np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)
        assert diff <= TOL, (jax.tree_util.keystr(path), diff)


def test_whole_model_calls_no_af2_attention_and_its_floor_none_of_the_family(whole_model):
    """With the swap no attention class of AF2's is called; the floor variant (the benchmark's
    'rest of the model': the five family modules' updates zero) has AF2's parameters less the
    family modules'. One test: the fixture compiles the model, once per xdist worker."""
    batch, _, calls, (cfg, params) = whole_model
    assert af2_model.af2_attention_calls(calls["ours"]) == {}
    assert set(af2_model.af2_attention_calls(calls["af2"])) == set(af2_package.REPLACEMENTS)
    ours = {cls for cls in calls["ours"] if cls.__module__.startswith("gated_attention")}
    assert set(af2_package.FAMILY.values()) | {af2_package.AF2Attention} <= ours
    t = af2_model.transformed(cfg, af2_model.FLOOR)
    with jax.enable_x64(False):
        floor = jax.eval_shape(t.init, jax.random.PRNGKey(0), af2_model.one_recycle(batch))
    family = {
        k for k in params if re.search(r"(msa_row|msa_column(_global)?|triangle)_attention", k)
    }
    assert family and set(floor) == set(params) - family
    with pytest.raises(
        ValueError,
        match=r"variant must be one of \('af2', 'ours', 'floor', 'colabfold', 'ours_colabfold'\)",
    ):
        af2_model.transformed(cfg, "fast")


def _clients_attention(client):
    """The client's own Attention class: alphafold-colabfold's or ColabDesign's (both clip)."""
    if client == "alphafold":
        return af2_package.original_class(modules, "Attention")
    if importlib.util.find_spec("colabdesign") is None:  # not importorskip: adapt imports it
        pytest.skip("needs colabdesign (the test extra)")
    ga.colabdesign.adapt_colabdesign()
    return af2_package.original_class(ga.colabdesign.colabdesign_modules(), "Attention")


@pytest.mark.parametrize("client", ["alphafold", "colabdesign"])
def test_attention_adapter_masks_a_row_without_keys_as_the_clients_clip_does(client):
    """AF2's additive mask bias, one batch row with no key: AF2 and ColabDesign clip the logits to
    +-1e8, so that row averages every key uniformly and sends no gradient to its logits. The
    adapter reads the bias as the mask it is (mask_from_bias) and matches the client's own module
    and the float64 reference, forward and gradients (q_data, m_data, the pair bias). Passed on as
    an additive bias instead (before 2026-12), the pair bias's gradient was 50 % off."""
    gc = _model_config().global_config
    cfg = ml_collections.ConfigDict({"num_head": 2, "gating": True, "key_dim": 8, "value_dim": 8})
    rng = np.random.default_rng(7)
    mask = np.ones((3, 5))
    mask[1], mask[2, 3:] = 0, 0  # batch row 1: no key; row 2: two keys masked
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    q, m = f32(rng.normal(size=(3, 5, 8))), f32(rng.normal(size=(3, 5, 8)))
    pair_bias = f32(rng.normal(size=(2, 5, 5)))
    bias = f32(1e9 * (mask - 1))[:, None, None, :]
    cotangent = f32(rng.normal(size=(3, 5, 8)))

    def transformed(cls):
        return hk.transform(lambda q, m, nb: cls(cfg, gc, 8)(q, m, bias, nb))

    params = family_benchmark.random_params(
        transformed(af2_package.AF2Attention), (q, m, pair_bias)
    )

    def value_and_grads(apply, *args):
        out, vjp = jax.vjp(apply, *args)
        return out, vjp(cotangent.astype(out.dtype))

    results = {}
    for name, cls in (("ours", af2_package.AF2Attention), ("own", _clients_attention(client))):
        apply = functools.partial(transformed(cls).apply, params, None)
        results[name] = value_and_grads(jax.jit(apply), q, m, pair_bias)
    with jax.enable_x64(True):
        exact = lambda *a: reference.attention(
            params["attention"], *a[:2], mask[:, None, None, :] > 0, a[2], xp=jnp
        )
        expected = value_and_grads(exact, *(jnp.asarray(x, jnp.float64) for x in (q, m, pair_bias)))
    for name in ("ours", "own"):
        out, grads = results[name]
        np.testing.assert_allclose(out, expected[0], **reference.tolerance(jnp.float32))
        for got, want in zip(grads, expected[1], strict=True):
            np.testing.assert_allclose(got, want, **reference.grad_tolerance(jnp.float32, want))
