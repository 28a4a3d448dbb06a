"""AlphaFold 3's own modules (alphafold3-colabfold) with their pair attention swapped for ours
(gated_attention.af3.use_gated_attention) against the same modules on AF3's XLA attention: the
trunk's PairFormerIteration (with its single track), the template stack (two PairFormerIterations
without it, as TemplateEmbedding stacks them) and the MSA stack's EvoformerIteration, forward and
gradients (of the parameters and the activations), float32 and bfloat16.

Every parameter is drawn at random (AF3 zero-initializes its output projections, under which any
attention would pass), padded tokens are masked, and each swapped trace is checked to have called
our op once per triangle attention, so the comparison cannot pass without our attention in it;
test_a_one_percent_scale_error_fails shows that it fails when the swap is made wrong.

float32: <= 1e-5 relative (family_benchmark.relative_diff, the largest over outputs and
gradients), or, for the stacked blocks whose float32 AF3 itself computes only to 4e-5 to 7.5e-4
(FLOAT64_ARBITER), float64 decides: ours equal to AF3's there, and ours' float32 of the order of
AF3's own float32 rounding. bfloat16 (AF3's precision: parameters cast by its bfloat16_context): ours in bfloat16
against AF3's float32 within BF16_MARGIN of AF3's own bfloat16-against-float32 difference. AF3's chemical-component tables: tests/af3/af3_modules.py (empty ones)."""

from __future__ import annotations

import contextlib
import functools

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gated_attention as ga
from gated_attention_tools import family_benchmark
from tests.af3 import af3_modules

N, S, C_Z, C_S, C_M, C_T, HEADS = 16, 4, 16, 32, 16, 32, 2  # tokens, MSA rows, channels, heads
PADDED = 3  # the last tokens are padding (masked)
TOL_F32 = 1e-5
# Where AF3's own float32 is far from float64 (its gradients of the first block's q and k
# projections: the template stack's two blocks 2.7e-5, the diffusion transformer's with random
# conditioning 4.4e-4, measured on this code), ours and AF3's float32 differ by that rounding,
# which moves with XLA's CPU code (5e-6 to 7e-4 seen for the diffusion transformer). There float64
# decides: ours in float64 equal to AF3's in float64 to TOL_F64 (the same function), and ours in
# float32 within the bound here of float64 (about 4x AF3's own float32 error: its rounding's order).
FLOAT64_ARBITER = {"template_stack": 1e-4, "diffusion": 2e-3}
TOL_F64 = 1e-6  # relative_diff compares in float32: a few of its ulps
BF16_MARGIN = 1.05  # the largest difference is in AF3's own layers (the same to 6 digits)


@functools.cache
def _af3():
    return af3_modules.load()


def _global_config():
    af3 = _af3()
    return af3.model_config.GlobalConfig(flash_attention_implementation="xla")


def pairformer(pair, pair_mask, single, seq_mask):
    """The trunk's block: two triangle attentions (ours when swapped), single attention AF3's."""
    af3 = _af3()
    config = af3.evoformer.Evoformer.PairformerConfig(
        num_layer=1,
        pair_attention={"num_head": HEADS},
        single_attention={"num_head": HEADS},
        single_transition={},
    )
    block = af3.modules.PairFormerIteration(
        config, _global_config(), with_single=True, name="trunk_pairformer"
    )
    return block(pair, pair_mask, single_act=single, seq_mask=seq_mask)


def template_stack(pair, pair_mask):
    """TemplateEmbedding's stack: its config's two pair-only PairFormerIterations, layer-stacked."""
    af3 = _af3()
    config = af3.template_modules.TemplateEmbedding.Config().template_stack
    config.pair_attention.num_head = HEADS

    def iteration(x):
        block = af3.modules.PairFormerIteration(
            config, _global_config(), name="template_embedding_iteration"
        )
        return block(act=x, pair_mask=pair_mask)

    return hk.experimental.layer_stack(config.num_layer)(iteration)(pair)


def msa_stack(msa, pair, msa_mask, pair_mask):
    """The MSA stack's block: its MSA attention is AF3's pair-weighted average (no keys), its
    triangle attentions ours when swapped."""
    af3 = _af3()
    config = af3.modules.EvoformerIteration.Config(
        msa_attention={"num_head": HEADS}, pair_attention={"num_head": HEADS}
    )
    block = af3.modules.EvoformerIteration(config, _global_config())
    return block({"msa": msa, "pair": pair}, {"msa": msa_mask, "pair": pair_mask})


def _inputs(name, dtype):
    """(inputs, which of them are differentiated): unit-normal activations, masks with PADDED
    tokens padded (in the activations' dtype, as AF3's trunk casts them)."""
    rng = np.random.default_rng(0)
    act = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
    seq_mask = jnp.asarray(np.arange(N) < N - PADDED, dtype)  # in the activations' dtype, as AF3's
    pair_mask = seq_mask[:, None] * seq_mask[None]
    if name == "pairformer":
        return (act(N, N, C_Z), pair_mask, act(N, C_S), seq_mask), (0, 2)
    if name == "template_stack":
        return (act(N, N, C_Z), pair_mask), (0,)
    if name == "diffusion":
        return (act(N, C_T), seq_mask, act(N, C_S), act(N, N, C_Z)), (0, 2, 3)
    msa_mask = jnp.broadcast_to(seq_mask, (S, N))
    return (act(S, N, C_M), act(N, N, C_Z), msa_mask, pair_mask), (0, 1)


def diffusion(act, mask, single_cond, pair_cond):
    """The diffusion head's token transformer (two blocks of inline self attention with the
    pair's logits: ours when swapped), its conditioning AF3's."""
    af3 = _af3()
    config = af3.diffusion_transformer.Transformer.Config(
        num_blocks=2, super_block_size=2, attention={"num_head": HEADS}
    )
    stack = af3.diffusion_transformer.Transformer(config, _global_config())
    return stack(act=act, mask=mask, single_cond=single_cond, pair_cond=pair_cond)


BLOCKS = {
    "pairformer": pairformer,
    "template_stack": template_stack,
    "msa_stack": msa_stack,
    "diffusion": diffusion,
}
# Our op's recorded calls in a swapped trace (AF3's own: none): each triangle attention records two
# (measured: a forward trace of PairFormerIteration's two records four), the inline attention one
# (the trunk's single attention; the diffusion transformer's, one per scanned block body).
CALLS = {"pairformer": 5, "template_stack": 4, "msa_stack": 4, "diffusion": 1}


def _step(fn, differentiated, swap, calls):
    """jit(params, *inputs) -> (outputs, gradients of a random projection of the outputs with
    respect to the parameters and the differentiated inputs), tracing fn inside `swap`."""

    def in_af3s_precision(*inputs):  # AF3's trunk: parameters cast to the inputs' dtype
        with _af3().utils.bfloat16_context():
            return fn(*inputs)

    t = hk.transform(in_af3s_precision)

    def step(params, cotangents, *inputs):
        def loss(params, *diffed):
            full = list(inputs)
            for i, x in zip(differentiated, diffed, strict=True):
                full[i] = x
            out = t.apply(params, jax.random.PRNGKey(1), *full)
            total = sum(
                jnp.sum(o.astype(jnp.float32) * c)
                for o, c in zip(jax.tree.leaves(out), cotangents, strict=True)
            )
            return total, out

        with swap, ga.record_implementation_choices() as record:
            diffed = [inputs[i] for i in differentiated]
            argnums = tuple(range(len(diffed) + 1))
            (_, out), grads = jax.value_and_grad(loss, argnums, has_aux=True)(params, *diffed)
        calls.append(len(record))
        return out, grads

    return t, jax.jit(step)


def _run(name, dtype, swapped, params=None, swap=None):
    """(params, (outputs, gradients)) of block `name` in `dtype`, AF3's attention or ours."""
    inputs, differentiated = _inputs(name, dtype)
    swap = swap or (
        ga.af3.use_gated_attention(inline=True) if swapped else contextlib.nullcontext()
    )
    calls = []
    t, step = _step(BLOCKS[name], differentiated, swap, calls)
    if params is None:
        params = family_benchmark.random_params(t, inputs)
    shapes = jax.eval_shape(lambda *a: t.apply(params, jax.random.PRNGKey(1), *a), *inputs)
    rng = np.random.default_rng(5)
    cotangents = [
        jnp.asarray(rng.normal(size=s.shape), jnp.float32) for s in jax.tree.leaves(shapes)
    ]
    result = step(params, cotangents, *inputs)
    assert calls == [CALLS[name] if swapped else 0], (name, dtype, swapped, calls)
    return params, result


@functools.cache
def _af3_float32(name):
    return _run(name, jnp.float32, swapped=False)


class _Float64Numpy:
    """jax.numpy with float32 read as float64: AF3's diffusion transformer casts q, k and the
    pair's logits to float32 whatever the inputs' dtype, so its float64 run is float32 there."""

    def __getattr__(self, name):
        return jnp.float64 if name == "float32" else getattr(jnp, name)


@functools.cache
def _af3_float64(name):
    """AF3's (outputs, gradients) in float64 throughout with _af3_float32's parameters."""
    p64 = jax.tree.map(lambda x: x.astype(jnp.float64), _af3_float32(name)[0])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_af3().diffusion_transformer, "jnp", _Float64Numpy())
        return _run(name, jnp.float64, swapped=False, params=p64)[1]


@functools.cache
def _bfloat16(name, swapped):
    """(outputs, gradients) in bfloat16 with _af3_float32's parameters (one compile per side)."""
    return _run(name, jnp.bfloat16, swapped=swapped, params=_af3_float32(name)[0])[1]


@pytest.mark.parametrize("name", list(BLOCKS))
def test_float32_matches_af3(name):
    params, expected = _af3_float32(name)
    _, actual = _run(name, jnp.float32, swapped=True, params=params)
    diff = family_benchmark.relative_diff(actual, expected)
    print(f"{name}: float32 {diff:.3g}")
    if diff > TOL_F32:  # then float64 arbitrates: ours no further from it than AF3's float32
        assert name in FLOAT64_ARBITER, (name, diff)
        exact = _af3_float64(name)
        p64 = jax.tree.map(lambda x: x.astype(jnp.float64), params)
        ours64 = family_benchmark.relative_diff(
            _run(name, jnp.float64, swapped=True, params=p64)[1], exact
        )
        ours, af3s = (family_benchmark.relative_diff(x, exact) for x in (actual, expected))
        print(f"{name}: float64 ours against AF3's {ours64:.3g}")
        print(f"{name}: float32 against float64, ours {ours:.3g}, AF3's own {af3s:.3g}")
        assert ours64 <= TOL_F64, (name, ours64)
        assert ours <= FLOAT64_ARBITER[name], (name, ours, af3s)


# bfloat16 through the trunk's block alone (~20 s on 2 cores a block): the template stack's block
# is the trunk's without the single track, and the MSA stack's triangle attentions are the trunk's
# module; float32 checks each of them.
@pytest.mark.parametrize("name", ["pairformer"])
def test_bfloat16_within_af3s_own_bfloat16_difference(name):
    _, reference = _af3_float32(name)
    af3, ours = _bfloat16(name, False), _bfloat16(name, True)
    af3_diff = family_benchmark.relative_diff(af3, reference)
    ours_diff = family_benchmark.relative_diff(ours, reference)
    print(f"{name}: bfloat16 ours {ours_diff:.3g} AF3 {af3_diff:.3g}")
    assert ours_diff <= BF16_MARGIN * af3_diff, (name, ours_diff, af3_diff)


def test_bfloat16_inline_forward_within_af3s_own_bfloat16_difference():
    """The diffusion transformer's output (sampling: no gradient) in bfloat16."""
    _, reference = _af3_float32("diffusion")
    af3, ours = _bfloat16("diffusion", False), _bfloat16("diffusion", True)
    af3_diff = family_benchmark.relative_diff(af3[0], reference[0])
    ours_diff = family_benchmark.relative_diff(ours[0], reference[0])
    print(f"diffusion: bfloat16 forward ours {ours_diff:.3g} AF3 {af3_diff:.3g}")
    assert ours_diff <= BF16_MARGIN * af3_diff, (ours_diff, af3_diff)


@pytest.mark.xfail(
    strict=True,
    reason="known, cause not found: through the diffusion transformer (two blocks, random "
    "conditioning: AF3's own float32 is 4.4e-4 from float64 and its bfloat16 gradients of q and k "
    "are ~100% off) ours' bfloat16 q and k gradients are ~8x further from float32 than AF3's. "
    "Why the inline half is opt-in",
)
def test_bfloat16_inline_gradients_within_af3s_own_bfloat16_difference():
    _, reference = _af3_float32("diffusion")
    af3, ours = _bfloat16("diffusion", False), _bfloat16("diffusion", True)
    af3_diff = family_benchmark.relative_diff(af3[1], reference[1])
    ours_diff = family_benchmark.relative_diff(ours[1], reference[1])
    assert ours_diff <= BF16_MARGIN * af3_diff, (ours_diff, af3_diff)


@contextlib.contextmanager
def _one_percent_scale_error():
    """The swap made wrong: our op's logits scaled 1% too much."""
    from gated_attention.af3 import swap as swap_module

    right = swap_module.api.dot_product_attention

    def wrong(q, k, v, bias=None, mask=None, *, scale=None, **kwargs):
        scale = 1.01 * (q.shape[-1] ** -0.5 if scale is None else scale)
        return right(q, k, v, bias, mask, scale=scale, **kwargs)

    with pytest.MonkeyPatch.context() as planted:
        planted.setattr(swap_module.api, "dot_product_attention", wrong)
        yield


def test_a_one_percent_scale_error_fails():
    """The float32 check with the swap made wrong: it must fail."""
    params, expected = _af3_float32("pairformer")
    with _one_percent_scale_error():
        _, actual = _run("pairformer", jnp.float32, swapped=True, params=params)
    diff = family_benchmark.relative_diff(actual, expected)
    print(f"pairformer, logits scaled 1% too much: float32 {diff:.3g}")
    assert diff > 10 * TOL_F32, diff


def test_a_one_percent_scale_error_fails_the_float64_arbiter():
    """The diffusion transformer's float64 check with the swap made wrong: it must fail."""
    p64 = jax.tree.map(lambda x: x.astype(jnp.float64), _af3_float32("diffusion")[0])
    with _one_percent_scale_error():
        _, actual = _run("diffusion", jnp.float64, swapped=True, params=p64)
    diff = family_benchmark.relative_diff(actual, _af3_float64("diffusion"))
    print(f"diffusion, logits scaled 1% too much: float64 {diff:.3g}")
    assert diff > 1e3 * TOL_F64, diff
