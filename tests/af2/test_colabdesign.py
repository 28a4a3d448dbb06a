"""ColabDesign's design steps with our attention (gated_attention.colabdesign) against ColabDesign's
own, through ColabDesign's own API (gated_attention_tools/design_model.py: mk_afdesign_model,
prep_inputs, run), on random parameters with every weight drawn (with AF2's zero-initialised last
layers every attention gives the same loss) and every stack one block deep (a full-depth step
compiles for minutes here; the benchmark takes the whole model).

The yardstick: the same model with its parameters nudged by 1e-6 (relative, two draws) moves the
sequence gradient by some amount; ours must be within 3x of that of ColabDesign's own, and its loss
within 1e-6 relative (or a tenth of what the nudges do to it). A 1 % scale planted in our logits
fails that. In bfloat16, as ColabDesign runs by default, the nudges are bfloat16's spacing.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import threading

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gated_attention as ga
from gated_attention.af2 import af2_package, colabdesign_jax
from gated_attention.core import platforms

if importlib.util.find_spec("colabdesign") is None:  # not importorskip: see adapt_colabdesign
    pytest.skip("needs colabdesign (the test extra)", allow_module_level=True)
from gated_attention_tools import design_model  # noqa: E402

RESIDUES, BLOCKS, NUDGE, YARDSTICKS = 24, 1, 1e-6, 3.0
NUDGE_BFLOAT16 = 2**-8  # bfloat16's relative spacing: nudges that move its rounding


@pytest.fixture(autouse=True)
def _cpu_float32_jax(monkeypatch):
    """ColabDesign as a CPU user runs it: JAX's default 32-bit types (the suite turns x64 on; its
    structure module's scan then meets float64), and our modules traced for the CPU alone (with
    the targets extra they also trace their GPU and TPU kernels: 10 s a step here)."""
    monkeypatch.setattr(platforms, "compilable", lambda: (platforms.host(),))
    with jax.enable_x64(False):
        yield


@functools.cache
def _model(case: str, bfloat16: bool):
    return design_model.build(case, RESIDUES, bfloat16=bfloat16, blocks=BLOCKS)


def _own_and_yardstick(model, nudge=NUDGE):
    """ColabDesign's own (loss, gradient) and how far `nudge`s of the parameters (relative, two
    draws) move them: (own, (the loss's relative move, the gradient's largest move))."""
    params = model._model_params[0]
    own = design_model.design_step(model, params)
    moved = [design_model.design_step(model, design_model.nudged(params, nudge, s)) for s in (1, 2)]
    model._model_params = [params]
    loss = max(abs(m[0] - own[0]) / abs(own[0]) for m in moved)
    return own, (loss, max(float(np.abs(m[1] - own[1]).max()) for m in moved))


def _ours(model):
    with ga.colabdesign.use_gated_attention():
        return design_model.design_step(model)


def _agrees(own, ours, yardstick, loss_bound):
    """Whether ours is within loss_bound (relative) of own's loss and YARDSTICKS yardsticks of
    its gradient: (ok, the figures)."""
    loss = abs(ours[0] - own[0]) / abs(own[0])
    grad = float(np.abs(ours[1] - own[1]).max())
    ok = loss <= loss_bound and grad <= YARDSTICKS * yardstick[1]
    return ok, dict(loss=loss, loss_bound=loss_bound, grad=grad, yardstick=yardstick)


def _float32_loss_bound(yardstick) -> float:
    """1e-6 relative, or a fifth of what the 1e-6 nudges do to the loss (float32's rounding of a
    loss that sensitive: in the hallucination case 1.7e-6 against nudges of 6e-5 in one install,
    4.1e-6 against 4.1e-5 in a fresh one of 2026-12-02, the same code: 0.10x, over a tenth)."""
    return max(1e-6, 0.2 * yardstick[0])


def _check_parity(case):
    """Ours against ColabDesign's own in float32 (the module docstring), and its own again after
    the swap (the jitted step outside it is ColabDesign's trace); returns (model, own, yardstick)."""
    model = _model(case, False)
    own, yardstick = _own_and_yardstick(model)
    assert yardstick[1] > 0 and np.abs(own[1]).max() > 0, "a yardstick of 0 checks nothing"
    ok, figures = _agrees(own, _ours(model), yardstick, _float32_loss_bound(yardstick))
    assert ok, f"{case}: {figures}"
    again = design_model.design_step(model)
    assert again[0] == own[0] and np.array_equal(again[1], own[1])
    return model, own, yardstick


@pytest.mark.parametrize("case", ["hallucination_multimer", "fixbb", "binder"])
def test_design_step_matches_colabdesigns_own_attention(case):
    _check_parity(case)


def test_hallucination_matches_and_a_one_percent_logit_error_fails(monkeypatch):
    """The check can fail: our op's logits scaled by 1.01 (its scale argument) in the same step."""
    model, own, yardstick = _check_parity("hallucination")
    from gated_attention.attention import api

    def planted(op):
        return lambda *args, scale=None, **kwargs: op(
            *args, scale=None if scale is None else 1.01 * scale, **kwargs
        )

    for name in ("dot_product_attention", "packed_dot_product_attention"):
        monkeypatch.setattr(api, name, planted(getattr(api, name)))
    # A swap of its own (without the layouts): ColabDesign's jitted step is traced again for it
    # (under the full swap jax.jit would serve the trace of the unplanted op).
    with ga.colabdesign.use_gated_attention(layouts=False):
        planted_step = design_model.design_step(model)
    _model.cache_clear()  # that trace stays in this model's jit cache: no other test gets it
    ok, figures = _agrees(own, planted_step, yardstick, _float32_loss_bound(yardstick))
    assert not ok, f"a 1 % logit error passed: {figures}"


def test_binder_multimer_as_bindcraft_runs_it_float32_and_bfloat16():
    """BindCraft's protocol (multimer weights, the target as template): float32 parity, then in
    ColabDesign's default bfloat16 ours against its own bfloat16 step within 3 yardsticks of
    nudges at bfloat16's resolution (NUDGE_BFLOAT16), loss and gradient."""
    _check_parity("binder_multimer")
    model = _model("binder_multimer", True)
    own, yardstick = _own_and_yardstick(model, NUDGE_BFLOAT16)
    ours = _ours(model)
    assert np.isfinite(ours[1]).all() and np.isfinite(ours[0])
    ok, figures = _agrees(own, ours, yardstick, YARDSTICKS * yardstick[0])
    assert ok, f"bfloat16: {figures}"


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
    from colabdesign.shared import utils

    # clear_mem (BindCraft calls it between designs) reaches get_backend through this view. Not
    # called here: it deletes every live buffer of the process, other tests' among them.
    assert utils.jax.lib.xla_bridge.get_backend().platform == "cpu"
    # ColabDesign's import set XLA_FLAGS to its flag alone; adapt_colabdesign kept the suite's.
    assert "--xla_force_host_platform_device_count=8" in os.environ["XLA_FLAGS"]
    assert colabdesign_jax.DESIGN_MODULES == ga.colabdesign.DESIGN_MODULES


def test_parameters_and_arguments_over_384_residues():
    """Over 384 residues ColabDesign's inference function has a runner of its own: the shapes are
    read through the gradient's, the same as at 24 residues; the step's arguments too."""
    long = design_model.build("hallucination", 400, bfloat16=False, blocks=BLOCKS, params=False)
    shapes = ga.colabdesign.param_shapes(long)
    assert shapes == ga.colabdesign.param_shapes(_model("hallucination", False))
    args = ga.colabdesign.step_arguments(long, shapes)
    assert args[1] == shapes and args[2]["aatype"].shape == (400,)
    with pytest.raises(ValueError, match="after prep_inputs"):
        ga.colabdesign.param_shapes(object())


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
