"""AlphaFold 2's own EvoformerIteration (the alphafold-colabfold package) with our attention swapped
in: the same parameters give AF2's outputs (float32 relative difference <= 1e-5). The training
step's gradients against AF2's are checked per module (tests/test_benchmarking.py's family cell)."""

import types

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gated_attention as ga
from gated_attention import af2_package
from gated_attention_tools import family_benchmark

config = pytest.importorskip("alphafold.model.config", reason="needs alphafold-colabfold")
modules = af2_package.alphafold_modules()

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
    attention is checked against the package's in tests/test_benchmarking.py's family cell."""
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
    originals = {name: getattr(modules, name) for name in af2_package.FAMILY}
    swap = af2_package.use_gated_attention()
    with swap as patched:
        assert patched is modules
        assert modules.TriangleAttention is ga.TriangleAttention
        with af2_package.use_gated_attention({"TriangleAttention": family_benchmark.ZeroUpdate}):
            assert modules.TriangleAttention is family_benchmark.ZeroUpdate
            assert modules.MSAColumnAttention is ga.MSAColumnAttention
        assert modules.TriangleAttention is ga.TriangleAttention
    assert {name: getattr(modules, name) for name in af2_package.FAMILY} == originals
    with pytest.raises(RuntimeError), swap:  # restored when the block raises too
        raise RuntimeError
    assert modules.MSARowAttentionWithPairBias is originals["MSARowAttentionWithPairBias"]


def test_swap_rejects_unknown_names_and_targets():
    with pytest.raises(ValueError, match=r"replacements names \['Attention'\].*expected keys"):
        af2_package.use_gated_attention({"Attention": ga.Attention})
    not_af2 = types.ModuleType("not_af2")
    swap = af2_package.use_gated_attention(target=not_af2)
    with pytest.raises(AttributeError, match="not_af2 has no"), swap:
        pass
    with af2_package.use_gated_attention():  # the lock was released after the failed entry
        pass
