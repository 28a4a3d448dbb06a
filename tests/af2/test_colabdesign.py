"""ColabDesign's design steps with our attention (gated_attention.colabdesign) against ColabDesign's
own, through ColabDesign's own API (gated_attention_tools/design_model.py: mk_afdesign_model,
prep_inputs, run), on random parameters with every weight drawn (with AF2's zero-initialised last
layers every attention gives the same loss) and every stack one block deep (a full-depth step
compiles for minutes here; the benchmark takes the whole model).

The yardstick: the same model with its parameters nudged by 1e-6 (relative, two draws) moves the
sequence gradient by some amount; ours must be within 3x of that of ColabDesign's own, and its loss
within 1e-6 relative. A 1 % scale planted in our logits fails that. In bfloat16, as ColabDesign
runs by default, ours must be no further from the float32 step than ColabDesign's own is.
"""

from __future__ import annotations

import functools
import threading

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gated_attention as ga
from gated_attention.af2 import af2_package, colabdesign_jax

pytest.importorskip("colabdesign", reason="needs colabdesign (the test extra)")
from gated_attention_tools import design_model  # noqa: E402

RESIDUES, BLOCKS, NUDGE, YARDSTICKS = 24, 1, 1e-6, 3.0
CASES = ["hallucination", "hallucination_multimer", "fixbb", "binder", "binder_multimer"]


@functools.cache
def _model(case: str, bfloat16: bool):
    return design_model.build(case, RESIDUES, bfloat16=bfloat16, blocks=BLOCKS)


def _own_and_yardstick(model):
    """ColabDesign's own (loss, gradient) and how far 1e-6 nudges of the parameters move it."""
    params = model._model_params[0]
    own = design_model.design_step(model, params)
    moved = [
        np.abs(design_model.design_step(model, design_model.nudged(params, NUDGE, s))[1] - own[1])
        for s in (1, 2)
    ]
    model._model_params = [params]
    return own, max(float(m.max()) for m in moved)


def _ours(model):
    with ga.colabdesign.use_gated_attention():
        return design_model.design_step(model)


def _agrees(own, ours, yardstick):
    loss = abs(ours[0] - own[0]) / abs(own[0])
    grad = float(np.abs(ours[1] - own[1]).max())
    return loss <= 1e-6 and grad <= YARDSTICKS * yardstick, (loss, grad, yardstick)


@pytest.mark.parametrize("case", CASES)
def test_design_step_matches_colabdesigns_own_attention(case):
    model = _model(case, False)
    own, yardstick = _own_and_yardstick(model)
    assert yardstick > 0 and np.abs(own[1]).max() > 0, "a yardstick of 0 checks nothing"
    ok, figures = _agrees(own, _ours(model), yardstick)
    assert ok, f"(loss relative, gradient max, yardstick) = {figures}"
    assert design_model.design_step(model) == pytest.approx(own, rel=0)  # its own again, after


def test_a_one_percent_logit_error_fails_the_check(monkeypatch):
    """The check can fail: our op's logits scaled by 1.01 (its scale argument) in the same step."""
    model = _model("hallucination", False)
    own, yardstick = _own_and_yardstick(model)
    from gated_attention.attention import api

    def planted(op):
        return lambda *args, scale=None, **kwargs: op(
            *args, scale=None if scale is None else 1.01 * scale, **kwargs
        )

    for name in ("dot_product_attention", "packed_dot_product_attention"):
        monkeypatch.setattr(api, name, planted(getattr(api, name)))
    jax.clear_caches()  # ColabDesign's jitted step would serve the trace of the unplanted op
    ok, figures = _agrees(own, _ours(model), yardstick)
    jax.clear_caches()
    assert not ok, f"a 1 % logit error passed: {figures}"


def test_bfloat16_step_no_further_from_float32_than_colabdesigns_own():
    """binder_multimer, BindCraft's protocol, in ColabDesign's default bfloat16: the gradient of
    ours against the float32 step, at most that of ColabDesign's own bfloat16 step (plus 10 %)."""
    exact = design_model.design_step(_model("binder_multimer", False))
    model = _model("binder_multimer", True)
    own, ours = design_model.design_step(model), _ours(model)
    error = lambda got: float(np.abs(got[1] - exact[1]).max())
    assert np.isfinite(ours[1]).all() and np.isfinite(ours[0])
    assert error(ours) <= 1.1 * error(own), (error(ours), error(own))
    assert abs(ours[0] - exact[0]) <= 1.1 * abs(own[0] - exact[0]) + 1e-6 * abs(exact[0])


def _built_classes():
    """The classes ColabDesign's modules.py builds for its attention names, in this thread."""
    from colabdesign.af.alphafold.model import config

    modules = ga.colabdesign.colabdesign_modules()
    c = config.model_config("model_3_ptm").model
    evo, gc = c.embeddings_and_evoformer.evoformer, c.global_config
    makes = dict(
        TriangleAttention=(evo.triangle_attention_starting_node, gc),
        MSARowAttentionWithPairBias=(evo.msa_row_attention_with_pair_bias, gc),
        Attention=(evo.msa_row_attention_with_pair_bias, gc, 8),
        GlobalAttention=(evo.msa_column_attention, gc, 8),
    )
    built = {}

    def build():
        for name, args in makes.items():
            built[name] = type(getattr(modules, name)(*args))

    hk.transform(build).init(None)
    return built


def test_the_swap_is_scoped_to_its_thread_and_its_context():
    outside = _built_classes()
    seen = {}
    with ga.colabdesign.use_gated_attention() as modules:
        assert modules.__name__ == "colabdesign.af.alphafold.model.modules"
        inside = _built_classes()
        other = threading.Thread(target=lambda: seen.update(_built_classes()))
        other.start()
        other.join()
    assert inside["TriangleAttention"] is ga.TriangleAttention
    assert inside["MSARowAttentionWithPairBias"] is ga.MSARowAttentionWithPairBias
    assert inside["Attention"] is af2_package.AF2Attention
    assert inside["GlobalAttention"] is af2_package.AF2GlobalAttention
    original = functools.partial(af2_package.original_class, ga.colabdesign.colabdesign_modules())
    for name, cls in outside.items():
        assert cls is original(name) and seen[name] is original(name), name
    assert _built_classes() == outside


def test_adapt_colabdesign_leaves_jax_unchanged():
    """ColabDesign's modules see the old names (1.1.3's jnp.clip keywords, 1.1.1's jax.tree_map
    and jax.util.wraps, clear_mem's jax.lib.xla_bridge); jax and every other module do not."""
    ga.colabdesign.adapt_colabdesign()
    assert ga.colabdesign.adapt_colabdesign() == []  # idempotent
    modules = ga.colabdesign.colabdesign_modules()
    x = jnp.arange(5.0)
    np.testing.assert_array_equal(modules.jnp.clip(x, a_min=1, a_max=3), jnp.clip(x, 1, 3))
    assert modules.jax.tree_map(lambda v: v + 1, [1]) == [2]
    assert modules.jax.lib.xla_bridge.get_backend().platform == "cpu"
    assert modules.jax.util.wraps(len)(lambda s: 0).__name__ == "len"
    with pytest.raises(TypeError, match="a_min"):
        jnp.clip(x, a_min=1)
    assert not hasattr(jax, "tree_map") and jnp.clip is not modules.jnp.clip
    with pytest.raises(TypeError, match="both a_min and min"):
        modules.jnp.clip(x, a_min=1, min=2)
    from colabdesign.shared.utils import clear_mem

    clear_mem()  # ColabDesign's, which BindCraft calls between designs
    assert colabdesign_jax.DESIGN_MODULES == ga.colabdesign.DESIGN_MODULES


def test_layouts_take_colabdesigns_call_signature():
    """The DAP layouts subclass ColabDesign's OuterProductMean(act, mask) and
    TriangleMultiplication(left_act, left_mask): without a mesh they compute ColabDesign's."""
    modules = ga.colabdesign.colabdesign_modules()
    layouts = af2_package.dap_layouts(modules)
    from colabdesign.af.alphafold.model import config

    c = config.model_config("model_3_ptm").model
    evo, gc = c.embeddings_and_evoformer.evoformer, c.global_config
    rng = np.random.default_rng(0)
    msa, msa_mask = jnp.asarray(rng.normal(size=(3, 6, 256)), jnp.float32), jnp.ones((3, 6))
    pair, pair_mask = jnp.asarray(rng.normal(size=(6, 6, 128)), jnp.float32), jnp.ones((6, 6))

    def both(make, *args):
        out = {}
        own = af2_package.original_class(modules, make)
        for name, cls in (("own", own), ("layout", layouts[make])):
            t = hk.transform(lambda *a, cls=cls: _build(cls, make, evo, gc)(*a))
            params = t.init(jax.random.key(0), *args)
            out[name] = t.apply(params, None, *args)
        return out

    for make, args in (
        ("OuterProductMean", (msa, msa_mask)),
        ("TriangleMultiplication", (pair, pair_mask)),
    ):
        out = both(make, *args)
        np.testing.assert_array_equal(out["own"], out["layout"])


def _build(cls, make, evo, gc):
    if make == "OuterProductMean":
        return cls(evo.outer_product_mean, gc, 128)
    return cls(evo.triangle_multiplication_incoming, gc)
