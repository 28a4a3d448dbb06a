"""Attention and GlobalAttention against the float64 reference and AlphaFold 2's own modules
(alphafold-colabfold's alphafold.model.modules)."""

import haiku as hk
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

import gated_attention as ga
from gated_attention.af2.modules import rows_per_tile
from gated_attention_tools import family_benchmark
from tests import reference
from tests.helpers import DTYPES, as_f64, assert_close, cast_tree, jit_reference, rand

IMPLEMENTATIONS = ("xla", "chunked")  # the modules' tests run on CPU

B, Q, K, A, M, H, O = 2, 5, 6, 12, 10, 2, 7


# Low-precision inputs run in their own dtype here (the 'input' policy), so that the reference
# tests check bfloat16/float16 arithmetic; tests/core/test_numerics.py checks the CPU default (float32).
GLOBAL = dict(zero_init=False, compute_dtype="input")
MIB = 2**20


def _attention(config, global_config=None, output_dim=O, **call_kwargs):
    global_config = GLOBAL if global_config is None else global_config

    def forward(q_data, m_data, mask=None, nonbatched_bias=None, bias=None):
        module = ga.Attention(config, global_config, output_dim)
        return module(q_data, m_data, mask, nonbatched_bias, bias=bias, **call_kwargs)

    return hk.without_apply_rng(hk.transform(forward))


def _global_attention(config, global_config=None, output_dim=O):
    global_config = GLOBAL if global_config is None else global_config
    return hk.without_apply_rng(
        hk.transform(
            lambda q, m, mask: ga.GlobalAttention(config, global_config, output_dim)(q, m, mask)
        )
    )


def _af2_package():
    """(alphafold.model.modules, alphafold.model.config) of the alphafold-colabfold package."""
    config = pytest.importorskip("alphafold.model.config", reason="needs alphafold-colabfold")
    return ga.af2_package.alphafold_modules(), config


def _af2_configs(num_head, gating=True, zero_init=False):
    """AF2's module config and model_1's global config (AF2's keys; its plain XLA path on CPU)."""
    _, config = _af2_package()
    global_config = config.model_config("model_1").model.global_config
    global_config.zero_init = zero_init
    return ml_collections.ConfigDict(dict(num_head=num_head, gating=gating)), global_config


def _af2_attention(gating=True, zero_init=False):
    """AF2's Attention as fn(q, m, mask, nonbatched_bias): the bool mask [b, 1|h, 1|q, k] passed
    as AF2's additive bias, 1e9 * (mask - 1)."""
    af2_modules, _ = _af2_package()
    config, global_config = _af2_configs(H, gating, zero_init)

    def forward(q_data, m_data, mask, nonbatched_bias=None):
        bias = 1e9 * (mask.astype(q_data.dtype) - 1.0)
        return af2_modules.Attention(config, global_config, O)(
            q_data, m_data, bias, nonbatched_bias
        )

    return hk.without_apply_rng(hk.transform(forward))


def _af2_global_attention(zero_init=False):
    """AF2's GlobalAttention as fn(q, m, q_mask), q_mask float [b, q, 1]."""
    af2_modules, _ = _af2_package()
    config, global_config = _af2_configs(H, True, zero_init)
    return hk.without_apply_rng(
        hk.transform(
            lambda q, m, q_mask: af2_modules.GlobalAttention(config, global_config, O)(q, m, q_mask)
        )
    )


# --------------------------------------------------------------------------------------------
# Parameters: AlphaFold 2's names, shapes, dtypes and initializers.


@pytest.mark.parametrize(
    "gating,zero_init,dtype",
    [(True, True, "float32"), (False, False, "bfloat16"), (True, False, "bfloat16")],
)
def test_attention_params_are_af2s(gating, zero_init, dtype):
    rng = np.random.default_rng(0)
    q_data, _ = rand(rng, (B, Q, A), dtype)
    m_data, _ = rand(rng, (B, K, M), dtype)
    config = dict(num_head=H, gating=gating)
    ours = _attention(config, dict(zero_init=zero_init))
    af2 = _af2_attention(gating=gating, zero_init=zero_init)
    # Both inits in one jitted program (compile time: the initializers' RNG code dominates).
    params, af2_params = jax.jit(
        lambda key: (
            ours.init(key, q_data, m_data)["attention"],
            af2.init(key, q_data, m_data, jnp.ones((1, 1, 1, 1), bool))["attention"],
        )
    )(jax.random.PRNGKey(7))
    c, cv = A // H, M // H
    expected = dict(
        query_w=(A, H, c), key_w=(M, H, c), value_w=(M, H, cv), output_w=(H, cv, O), output_b=(O,)
    )
    if gating:
        expected.update(gating_w=(A, H, cv), gating_b=(H, cv))
    assert {k: v.shape for k, v in params.items()} == expected
    assert all(v.dtype == jnp.dtype(dtype) for v in params.values())
    if gating:
        assert np.all(np.asarray(params["gating_w"], np.float32) == 0)
        assert np.all(np.asarray(params["gating_b"], np.float32) == 1)
    assert np.all(np.asarray(params["output_b"], np.float32) == 0)
    out_w = np.asarray(params["output_w"], np.float32)
    assert np.all(out_w == 0) if zero_init else np.any(out_w != 0)
    # Glorot uniform, Haiku's fans for [x, y, z]: fan_in = x * y, fan_out = x * z.
    for name, (x, y, z) in [("query_w", (A, H, c)), ("output_w", (H, cv, O))]:
        if name == "output_w" and zero_init:
            continue
        limit = np.sqrt(3.0 / ((x * y + x * z) / 2))
        w = np.abs(np.asarray(params[name], np.float32))
        assert w.max() <= limit * 1.01 and w.max() > 0.8 * limit, name
    # Same initializers in the same order as AF2's module: identical params from the same key.
    jax.tree.map(np.testing.assert_array_equal, af2_params, params)


def test_attention_key_and_value_dims():
    q_data, _ = rand(np.random.default_rng(0), (B, Q, A), "float32")
    params = jax.eval_shape(
        _attention(dict(num_head=H, key_dim=8, value_dim=6)).init,
        jax.random.PRNGKey(0),
        q_data,
        q_data,
    )["attention"]
    assert params["query_w"].shape == (A, H, 4) and params["value_w"].shape == (A, H, 3)
    assert params["gating_w"].shape == (A, H, 3) and params["output_w"].shape == (H, 3, O)


def test_global_attention_params_are_af2s():
    q_data, _ = rand(np.random.default_rng(0), (B, Q, A), "bfloat16")
    mask = jnp.ones((B, Q, 1), jnp.bfloat16)
    ours, af2 = _global_attention(dict(num_head=H)), _af2_global_attention(zero_init=False)
    # Both inits in one jitted program (compile time: the initializers' RNG code dominates).
    params, af2_params = jax.jit(
        lambda key: (ours.init(key, q_data, q_data, mask), af2.init(key, q_data, q_data, mask))
    )(jax.random.PRNGKey(3))
    c = A // H
    shapes = {k: v.shape for k, v in params["attention"].items()}
    assert shapes == dict(
        query_w=(A, H, c),
        key_w=(A, c),
        value_w=(A, c),
        gating_w=(A, H, c),
        gating_b=(H, c),
        output_w=(H, c, O),
        output_b=(O,),
    )
    jax.tree.map(np.testing.assert_array_equal, af2_params, params)


# --------------------------------------------------------------------------------------------
# Forward against the float64 reference.

# name -> (mask shape, nonbatched_bias shape, bias shape); None = absent.
CASES = {
    "key_mask+nonbatched_hqk": ((B, 1, 1, K), (H, Q, K), None),
    "qk_mask+nonbatched_qk": ((B, 1, Q, K), (Q, K), None),
    "3d_mask+additive_bias": ((B, Q, K), None, (B, 1, 1, K)),
    "full_mask+both_biases": ((B, H, Q, K), (H, Q, K), (B, H, Q, K)),
    "nothing": (None, None, None),
}


def _module_problem(dtype, case, seed=0, gating=True):
    rng = np.random.default_rng(seed)
    mask_shape, nb_shape, bias_shape = CASES[case]
    q_data, q64 = rand(rng, (B, Q, A), dtype)
    m_data, m64 = rand(rng, (B, K, M), dtype)
    mask = None if mask_shape is None else jnp.asarray(rng.random(mask_shape) > 0.3)
    nb, nb64 = rand(rng, nb_shape, dtype) if nb_shape else (None, None)
    bias, bias64 = rand(rng, bias_shape, dtype) if bias_shape else (None, None)
    params64 = reference.random_attention_params(rng, A, M, H, A // H, M // H, O, gating=gating)
    params = cast_tree(params64, dtype)
    ours = (dict(attention=params), q_data, m_data, mask, nb, bias)
    ref = (as_f64(params), q64, m64, None if mask is None else np.asarray(mask), nb64, bias64)
    return ours, ref


def _failures(checks) -> list[str]:
    """Runs every (name, check) and returns the messages of those that fail (all, not the first)."""
    failures = []
    for name, check in checks:
        try:
            check()
        except AssertionError as e:
            failures.append(f"--- {name}: {e}")
    return failures


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_matches_reference(implementation, dtype):
    """Every mask/bias form of CASES, all in one jitted program per implementation and dtype
    (compile time: one program, not one per case)."""
    problems = {case: _module_problem(dtype, case) for case in CASES}
    module = _attention(dict(num_head=H), dict(attention_implementation=implementation))
    outs = jax.jit(lambda args: [module.apply(*a) for a in args])([p[0] for p in problems.values()])

    def check(out, ref):
        params64, *ref_inputs = ref
        assert out.dtype == jnp.dtype(dtype) and out.shape == (B, Q, O)
        assert_close(out, reference.attention(params64, *ref_inputs), reference.tolerance(dtype))

    checks = [
        (case, lambda out=out, p=p: check(out, p[1]))
        for (case, p), out in zip(problems.items(), outs, strict=True)
    ]
    failures = _failures(checks)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_without_gating_matches_reference(dtype):
    (params, *inputs), (params64, *ref_inputs) = _module_problem(
        dtype, "key_mask+nonbatched_hqk", gating=False
    )
    out = _attention(dict(num_head=H, gating=False)).apply(params, *inputs)  # eager
    expected = reference.attention(params64, *ref_inputs, gating=False)
    assert_close(out, expected, reference.tolerance(dtype))


def test_attention_extra_leading_batch_axes():
    rng = np.random.default_rng(1)
    q_data, q64 = rand(rng, (3, B, Q, A), "float32")
    m_data, m64 = rand(rng, (3, B, K, M), "float32")
    mask = jnp.asarray(rng.random((3, B, 1, 1, K)) > 0.3)
    nb, nb64 = rand(rng, (H, Q, K), "float32")
    params64 = reference.random_attention_params(rng, A, M, H, A // H, M // H, O)
    out = jax.jit(_attention(dict(num_head=H)).apply)(
        dict(attention=cast_tree(params64, "float32")), q_data, m_data, mask, nb
    )
    for i in range(3):
        expected = reference.attention(params64, q64[i], m64[i], np.asarray(mask[i]), nb64)
        assert_close(out[i], expected, reference.tolerance("float32"))


def _jit_grad(fn, argnums):
    """jit(grad(fn)) of the float64 reference (jitted: one program, not an op-by-op dispatch)."""
    return jit_reference(jax.grad(fn, argnums=tuple(range(argnums))))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_gradients_match_reference(implementation, dtype):
    (params, q_data, m_data, mask, nb, bias), (params64, q64, m64, mask64, nb64, bias64) = (
        _module_problem(dtype, "full_mask+both_biases", seed=2)
    )
    module = _attention(dict(num_head=H), dict(attention_implementation=implementation))

    def loss(params, q_data, m_data, nb, bias):
        return jnp.sum(
            module.apply(params, q_data, m_data, mask, nb, bias).astype(jnp.float32) ** 2
        )

    def ref_loss(params, q_data, m_data, nb, bias):
        return jnp.sum(
            reference.attention(params["attention"], q_data, m_data, mask64, nb, bias, xp=jnp) ** 2
        )

    grads = jax.jit(jax.grad(loss, argnums=range(5)))(params, q_data, m_data, nb, bias)
    ref = _jit_grad(ref_loss, 5)(dict(attention=params64), q64, m64, nb64, bias64)
    tol = reference.grad_tolerance(dtype)
    if dtype == "bfloat16":  # squared loss: gradients are O(output), rounding accumulates
        tol = dict(rtol=1e-1, atol=1e-1)
    jax.tree.map(lambda g, r: assert_close(g, r, tol), grads, ref)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_fully_masked_rows_finite_with_finite_gradients(implementation):
    """bfloat16, float16 and float32, one jitted program for the three."""
    mask = np.ones((B, 1, Q, K), bool)
    mask[0] = False  # batch 0 sees nothing
    mask[1, :, 2] = False  # query 2 of batch 1 sees nothing
    module = _attention(dict(num_head=H), dict(attention_implementation=implementation))
    dtypes = ("bfloat16", "float16", "float32")
    problems = [_module_problem(dtype, "key_mask+nonbatched_hqk") for dtype in dtypes]

    def loss(params, q_data, m_data, nb):
        out = module.apply(params, q_data, m_data, jnp.asarray(mask), nb)
        return jnp.sum(out.astype(jnp.float32)), out

    grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    results = jax.jit(lambda args: [grad(p, q, m, nb) for p, q, m, _, nb, _ in args])(
        [p[0] for p in problems]
    )

    def check(dtype, result, ref):
        (_, out), grads = result
        params64, q64, m64, _, nb64, _ = ref
        for leaf in jax.tree.leaves((out, grads)):
            assert bool(jnp.isfinite(leaf.astype(jnp.float32)).all())
        expected = reference.attention(params64, q64, m64, mask, nb64)
        assert_close(out, expected, reference.tolerance(dtype))

    checks = [
        (dtype, lambda d=dtype, r=result, p=p: check(d, r, p[1]))
        for dtype, result, p in zip(dtypes, results, problems, strict=True)
    ]
    failures = _failures(checks)
    assert not failures, "\n".join(failures)


def test_af2_params_apply_unchanged_and_match():
    (params, q_data, m_data, mask, nb, _), _ = _module_problem("float32", "key_mask+nonbatched_hqk")
    af2 = _af2_attention()
    # Random values in the tree AF2's init makes (traced only: no RNG program compiled).
    af2_params = family_benchmark.random_params(af2, (q_data, m_data, mask, nb), seed=11)
    ours = jax.jit(_attention(dict(num_head=H, gating=True)).apply)(
        af2_params, q_data, m_data, mask, nb
    )
    theirs = jax.jit(af2.apply)(af2_params, q_data, m_data, mask, nb)
    rel = float(jnp.max(jnp.abs(ours - theirs)) / jnp.max(jnp.abs(theirs)))
    assert rel <= 1e-5


def test_bfloat16_at_least_as_accurate_as_af2():
    errors = {"ours": [], "af2": []}
    ours_apply = jax.jit(_attention(dict(num_head=H)).apply)
    af2_apply = jax.jit(_af2_attention().apply)
    for seed in range(4):
        (params, *inputs), (params64, *ref_inputs) = _module_problem(
            "bfloat16", "key_mask+nonbatched_hqk", seed
        )
        expected = reference.attention(params64, *ref_inputs)
        ours = ours_apply(params, *inputs[:4])
        theirs = af2_apply(params, *inputs[:4])
        for name, out in (("ours", ours), ("af2", theirs)):
            errors[name].append(np.mean(np.abs(np.asarray(out, np.float64) - expected)))
    assert np.mean(errors["ours"]) <= np.mean(errors["af2"])


# --------------------------------------------------------------------------------------------
# GlobalAttention.


def _global_problem(dtype, gating, mask_dtype, seed=0):
    rng = np.random.default_rng(seed)
    q_data, q64 = rand(rng, (B, Q, A), dtype)
    mask64 = (rng.random((B, Q, 1)) > 0.3).astype(np.float64)
    mask64[1] = 0.0  # batch 1 fully masked
    mask = jnp.asarray(mask64, mask_dtype)
    params64 = reference.random_global_attention_params(
        rng, A, A, H, A // H, A // H, O, gating=gating
    )
    return (dict(attention=cast_tree(params64, dtype)), q_data, mask), (
        as_f64(params64),
        q64,
        mask64,
    )


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_global_attention_matches_reference(implementation, dtype):
    """Gated (a bool mask) and ungated (a float mask, as AF2 passes it), in one jitted program."""
    gatings = (True, False)
    transformed = [
        _global_attention(
            dict(num_head=H, gating=gating), dict(attention_implementation=implementation)
        )
        for gating in gatings
    ]
    # AF2 passes float masks; bool works too
    problems = [_global_problem(dtype, g, bool if g else dtype) for g in gatings]
    outs = jax.jit(
        lambda args: [
            m.apply(p, q, q, mask) for m, (p, q, mask) in zip(transformed, args, strict=True)
        ]
    )([p[0] for p in problems])

    def check(gating, out, ref):
        params64, q64, mask64 = ref
        assert out.dtype == jnp.dtype(dtype) and out.shape == (B, Q, O)
        assert bool(jnp.isfinite(out.astype(jnp.float32)).all())
        expected = reference.global_attention(params64, q64, q64, mask64, gating=gating)
        assert_close(out, expected, reference.tolerance(dtype))

    checks = [
        (f"gating={g}", lambda g=g, out=out, p=p: check(g, out, p[1]))
        for g, out, p in zip(gatings, outs, problems, strict=True)
    ]
    failures = _failures(checks)
    assert not failures, "\n".join(failures)


def test_global_attention_gradients_and_af2_params():
    (params, q_data, mask), (params64, q64, mask64) = _global_problem("float32", True, jnp.float32)
    module = _global_attention(dict(num_head=H))
    loss = lambda p, q: jnp.sum(module.apply(p, q, q, mask) ** 2)
    ref_loss = lambda p, q: jnp.sum(
        reference.global_attention(p["attention"], q, q, mask64, xp=jnp) ** 2
    )
    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, q_data)
    ref = _jit_grad(ref_loss, 2)(dict(attention=params64), q64)
    jax.tree.map(lambda g, r: assert_close(g, r, reference.grad_tolerance("float32")), grads, ref)
    theirs = jax.jit(_af2_global_attention().apply)(params, q_data, q_data, mask)
    np.testing.assert_allclose(
        jax.jit(module.apply)(params, q_data, q_data, mask), theirs, rtol=1e-5, atol=1e-6
    )


def test_global_attention_positions_first_is_the_transposed_problem():
    """positions_first: [q, b, a] in and [q, b, o] out, the same values and gradients as the
    [b, q, a] problem transposed, in row tiles (a tiny budget: tiles along the batch axis 1)."""
    (params, q_data, mask), (params64, q64, mask64) = _global_problem("float32", True, jnp.float32)
    tiled = dict(GLOBAL, memory_budget_mib=1e-6)

    def first(q, mask):
        attention = ga.GlobalAttention(dict(num_head=H), tiled, O)
        t = lambda x: jnp.swapaxes(x, 0, 1)
        return t(attention(t(q), t(q), t(mask), positions_first=True))

    module = hk.without_apply_rng(hk.transform(first))
    loss = lambda p, q: jnp.sum(module.apply(p, q, mask) ** 2)
    jaxpr = str(jax.make_jaxpr(module.apply)(params, q_data, mask))
    assert "scan" in jaxpr  # really tiled
    out, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, q_data)
    ref_loss = lambda p, q: jnp.sum(
        reference.global_attention(p["attention"], q, q, mask64, xp=jnp) ** 2
    )
    ref_out, ref = jit_reference(jax.value_and_grad(ref_loss, argnums=(0, 1)))(
        dict(attention=params64), q64
    )
    assert_close(out, ref_out, reference.tolerance("float32"))
    jax.tree.map(lambda g, r: assert_close(g, r, reference.grad_tolerance("float32")), grads, ref)
    with pytest.raises(ValueError, match=r"positions_first takes q_data \[q, b, a\]"):
        _global_attention_apply(q_data[None], positions_first=True)
    with pytest.raises(ValueError, match=r"q_mask of shape \(2, 3\) must be \[q, b, 1\]"):
        _global_attention_apply(q_data, mask=jnp.ones((2, 3), bool), positions_first=True)


def _global_attention_apply(q_data, mask=None, **kwargs):
    mask = jnp.ones(q_data.shape[:-1], bool) if mask is None else mask
    fn = lambda q, m: ga.GlobalAttention(dict(num_head=H), GLOBAL, O)(q, q, m, **kwargs)
    return jax.eval_shape(hk.transform(fn).init, jax.random.PRNGKey(0), q_data, mask)


@pytest.mark.parametrize(
    "implementation, remat_policy", [("xla", "nothing"), ("chunked", "projections")]
)
def test_row_tiled_forward_matches_reference_with_gradients(implementation, remat_policy):
    """The whole forward in tiles of one row (a budget below one row's working set), each
    checkpointed with the remat policy: forward and gradients as the untiled reference."""
    rng = np.random.default_rng(5)
    b = 5
    q_data, q64 = rand(rng, (b, Q, A), "float32")
    m_data, m64 = rand(rng, (b, K, M), "float32")
    mask = jnp.asarray(rng.random((b, 1, 1, K)) > 0.3)
    nb, nb64 = rand(rng, (H, Q, K), "float32")
    params64 = reference.random_attention_params(rng, A, M, H, A // H, M // H, O)
    params = dict(attention=cast_tree(params64, "float32"))
    global_config = dict(
        GLOBAL,
        attention_implementation=implementation,
        memory_budget_mib=1e-6,
        remat_policy=remat_policy,
    )
    module = _attention(dict(num_head=H), global_config)
    jaxpr = str(jax.make_jaxpr(module.apply)(params, q_data, m_data, mask, nb))
    # Really tiled, under every policy through the loop's own custom VJP (mapping.tiled).
    assert "scan" in jaxpr or "while" in jaxpr
    assert "run_bwd" in jaxpr
    out = jax.jit(module.apply)(params, q_data, m_data, mask, nb)
    expected = reference.attention(params64, q64, m64, np.asarray(mask), nb64)
    assert_close(out, expected, reference.tolerance("float32"))

    def loss(params, q_data, nb):
        return jnp.sum(module.apply(params, q_data, m_data, mask, nb) ** 2)

    def ref_loss(params, q_data, nb):
        out = reference.attention(params["attention"], q_data, m64, np.asarray(mask), nb, xp=jnp)
        return jnp.sum(out**2)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(params, q_data, nb)
    # A policy that keeps something checkpoints each tile with it; 'nothing' recomputes.
    grad_jaxpr = str(jax.make_jaxpr(jax.grad(loss))(params, q_data, nb))
    assert ("remat" in grad_jaxpr or "checkpoint" in grad_jaxpr) == (remat_policy != "nothing")
    ref = _jit_grad(ref_loss, 3)(dict(attention=params64), q64, nb64)
    jax.tree.map(lambda g, r: assert_close(g, r, reference.grad_tolerance("float32")), grads, ref)


def test_remat_policy_sets_what_a_training_step_keeps():
    """XLA's temp bytes of a tiled training step: 'nothing' (the default) < 'projections' <
    'everything'."""
    specs = (jax.ShapeDtypeStruct((64, 128, 64), jnp.float32),) * 2

    def temp(policy, budget_mib=1.0):
        global_config = dict(GLOBAL, remat_policy=policy, memory_budget_mib=budget_mib)
        module = _attention(dict(num_head=4), global_config)
        params = jax.eval_shape(module.init, jax.random.PRNGKey(0), *specs)
        loss = lambda p, q, m: jnp.sum(module.apply(p, q, m))
        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        return step.lower(params, *specs).compile().memory_analysis().temp_size_in_bytes

    nothing, projections, everything = (temp(p) for p in ("nothing", "projections", "everything"))
    assert nothing < projections < everything
    assert ga.GlobalConfig().remat_policy == "nothing"


def _rows(
    batch, subbatch_size=None, budget=64 * MIB, row=MIB, tile_row=MIB, queries=64, logits=None,
    platform=None, itemsize=4,
):  # fmt: skip
    return rows_per_tile(
        batch,
        subbatch_size,
        budget,
        row_bytes=row,
        tile_row_bytes=tile_row,
        row_queries=queries,
        row_logits=logits,
        platform=platform,
        itemsize=itemsize,
    )


def test_rows_per_tile_rule():
    # Half the budget (the other half for the stacked outputs and cotangents), by our row's bytes.
    assert _rows(1000) == 32
    assert _rows(1000, subbatch_size="auto") == 32
    assert _rows(1000, tile_row=3 * MIB) == 10
    # A batch that fits one tile is not tiled; at least one row a tile.
    assert _rows(32) is None
    assert _rows(1000, budget=1) == 1
    # AF2's subbatch_size as the memory bound it exists for: what AF2's dense attention takes for
    # that many rows (8 MiB each here), when that is more than the budget; never 4-row tiles.
    assert _rows(1000, subbatch_size=4, budget=MIB, row=8 * MIB) == 32
    assert _rows(1000, subbatch_size=4, row=8 * MIB, tile_row=2 * MIB) == 16
    assert _rows(1000, subbatch_size=1, row=2 * MIB) == 32
    # On CPU, also cut to about 2 MiB of float32 logits once such a tile holds 1,024 queries:
    # 4 heads x 128 x 128 logits -> 8 rows of 128 queries; with 64 queries a row, no cut.
    assert _rows(1000, queries=128, logits=4 * 128 * 128) == 8
    assert _rows(1000, queries=64, logits=4 * 64 * 64) == 32
    # A row whose logits alone exceed the cache tile: only the memory bound.
    assert _rows(1000, queries=1024, logits=4 * 1024 * 1024) == 32


def test_row_tile_rule_is_cpu_only(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert _rows(1000, queries=128, logits=4 * 128 * 128) == 32


def test_a_modules_own_memory_budget_reaches_its_tiles_and_its_pair_bias(monkeypatch):
    """config.memory_budget_mib overrides the global one for everything the module decides by
    it: the op's choice, the module's row tiles and the pair bias's tiles (before, the tiles read
    the global budget alone)."""
    from gated_attention.af2 import modules, pair_bias

    seen = {}
    rows = modules.rows_per_tile
    monkeypatch.setattr(
        modules, "rows_per_tile", lambda *a, **k: seen.setdefault("tiles", a[2]) and rows(*a, **k)
    )
    with_pair = pair_bias.with_pair
    monkeypatch.setattr(
        pair_bias, "with_pair", lambda *a: seen.setdefault("pair", a[-1]("cpu")) and with_pair(*a)
    )
    cfg = dict(num_head=2, orientation="per_row", memory_budget_mib=3)
    gc = dict(memory_budget_mib=1024)
    fn = hk.transform(lambda p, m: ga.TriangleAttention(cfg, gc)(p, m, False))
    pair, mask = jnp.ones((6, 6, 8)), jnp.ones((6, 6))
    fn.apply(fn.init(jax.random.PRNGKey(0), pair, mask), None, pair, mask)
    assert seen == dict(tiles=3 * 2**20, pair=3 * 2**20)


def test_a_placement_handed_down_is_not_derived_again():
    """The module around Attention resolves the placement once and hands it down
    (sharding.Placement): Attention then reads none of global_config's mesh axes again. Here
    they name an axis of no mesh: resolved again, that raises."""
    from gated_attention.parallel import sharding

    config, global_config = dict(num_head=H), dict(GLOBAL, shard_rows_over="rows")
    q, _ = rand(np.random.default_rng(0), (B, Q, A), "float32")

    def attend(placement):
        module = ga.Attention(config, global_config, O, placement=placement)
        return module(q, q)

    params = hk.transform(lambda: attend(None)).init(jax.random.key(1))  # init: outside meshes
    out = hk.transform(lambda: attend(sharding.Placement())).apply(params, None)
    assert out.shape == (B, Q, O) and bool(jnp.isfinite(out).all())
    with pytest.raises(ValueError, match="no mesh is set"):
        hk.transform(lambda: attend(None)).apply(params, None)
    with pytest.raises(TypeError, match="placement must be a sharding.Placement"):
        hk.transform(lambda: attend("rows")).init(jax.random.key(1))


def test_the_default_budget_follows_the_platform(monkeypatch):
    """memory_budget_mib None (the default): 256 MiB on CPU and TPU, gpu_memory_fraction of the
    GPU's memory on a GPU (never less than 256 MiB), the CPU's where the GPU's is unknown; a
    number set applies everywhere."""
    from gated_attention.af2 import config as config_lib
    from gated_attention.core import platforms

    resolved = lambda gc: config_lib.resolve(config_lib.module_config(dict(num_head=1)), gc)
    default = resolved(ga.GlobalConfig())
    monkeypatch.setattr(platforms, "gpu_memory_bytes", lambda: 80 * 10**9)
    assert default.budget_bytes("cpu") == default.budget_bytes("tpu") == 256 * MIB
    assert default.budget_bytes("gpu") == 8 * 10**9
    assert resolved(ga.GlobalConfig(gpu_memory_fraction=0.25)).budget_bytes("gpu") == 20 * 10**9
    assert resolved(ga.GlobalConfig(memory_budget_mib=64)).budget_bytes("gpu") == 64 * MIB
    monkeypatch.setattr(platforms, "gpu_memory_bytes", lambda: 10**9)
    assert default.budget_bytes("gpu") == 256 * MIB
    monkeypatch.setattr(platforms, "gpu_memory_bytes", lambda: None)
    assert default.budget_bytes("gpu") == 256 * MIB


def test_a_gpus_memory_is_read_from_its_kind_where_it_has_no_stats(monkeypatch):
    """A deviceless compile's abstract GPU has a kind and no memory_stats."""
    from gated_attention.core import platforms

    class Device:
        def __init__(self, kind):
            self.device_kind = kind

    for kind, expected in [
        ("NVIDIA H100 80GB HBM3", 80 * 10**9),
        ("NVIDIA A100-SXM4-40GB", 40 * 10**9),
        ("NVIDIA H200", 141 * 10**9),
        ("NVIDIA GeForce RTX 4090", 24 * 10**9),
        ("NVIDIA Unknown", None),
    ]:
        monkeypatch.setattr(platforms, "_gpu", lambda kind=kind: Device(kind))
        assert platforms.gpu_memory_bytes() == expected, kind


def test_rows_per_tile_is_one_call_on_a_gpu_when_all_rows_fit():
    """On a GPU the rows' whole working set in the compute dtype against the whole budget: one
    call; where it does not fit, half the budget a tile, as on CPU."""
    assert _rows(1000, budget=1000 * MIB, tile_row=MIB, platform="gpu") is None
    assert _rows(1000, budget=1000 * MIB, tile_row=MIB) == 500  # CPU: half the budget a tile
    assert _rows(1000, budget=500 * MIB, tile_row=MIB, platform="gpu", itemsize=2) is None
    assert _rows(1000, budget=500 * MIB, tile_row=MIB, platform="gpu") == 250


def test_pair_bias_tiles_are_one_on_a_gpu_when_all_rows_fit():
    """The pair bias's tiles follow the modules' rule: on a GPU one tile where every pair row's
    working set (six float32 arrays of a row) fits the whole budget, else a quarter a tile."""
    from gated_attention.af2 import pair_bias
    from gated_attention.core import memory

    shape, row = (1024, 1024, 128), memory.pair_bias_row_bytes(1024, 128)
    assert pair_bias.tile_rows(shape, 1024 * row, "gpu") == 1024
    assert pair_bias.tile_rows(shape, 1024 * row, "cpu") == 256
    assert pair_bias.tile_rows(shape, 1023 * row, "gpu") == 255
