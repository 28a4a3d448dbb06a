"""AlphaFold 2's attention family, dropout, inference subbatching and AF2 checkpoints.

Every forward is jit-compiled (eager Haiku costs seconds per call here) on tiny shapes.
"""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gated_attention as ga
from gated_attention.af2 import params as params_lib
from tests import reference
from tests.helpers import as_f64, assert_close, jit_reference, rand

IMPLEMENTATIONS = ("xla", "chunked")

S, R, C_M, C_Z, H = 5, 6, 8, 6, 2  # MSA sequences, residues, MSA/pair channels, heads
GLOBAL = dict(zero_init=False)  # AF2's default subbatch_size (4) stays: S = 5 runs 4 + 1

ROW = dict(num_head=H, orientation="per_row")
COLUMN = dict(num_head=H, orientation="per_column")

# variant -> (module class, config, reference function, reference params builder)
VARIANTS = {
    "msa_row": (
        ga.MSARowAttentionWithPairBias,
        ROW,
        reference.msa_row_attention_with_pair_bias,
        lambda rng: reference.random_msa_row_attention_params(rng, C_M, C_Z, H),
    ),
    "msa_column": (
        ga.MSAColumnAttention,
        COLUMN,
        reference.msa_column_attention,
        lambda rng: reference.random_msa_column_attention_params(rng, C_M, H),
    ),
    "msa_column_global": (
        ga.MSAColumnGlobalAttention,
        COLUMN,
        reference.msa_column_global_attention,
        lambda rng: reference.random_msa_column_global_attention_params(rng, C_M, H),
    ),
    "triangle_start": (
        ga.TriangleAttention,
        ROW,
        lambda p, z, m: reference.triangle_attention(p, z, m, orientation="per_row"),
        lambda rng: reference.random_triangle_attention_params(rng, C_Z, H),
    ),
    "triangle_end": (
        ga.TriangleAttention,
        COLUMN,
        lambda p, z, m: reference.triangle_attention(p, z, m, orientation="per_column"),
        lambda rng: reference.random_triangle_attention_params(rng, C_Z, H),
    ),
}


def _transform(module_cls, config, global_config=GLOBAL, name=None, **call_kwargs):
    kwargs = {} if name is None else dict(name=name)
    return hk.without_apply_rng(
        hk.transform(lambda *a: module_cls(config, global_config, **kwargs)(*a, **call_kwargs))
    )


def _haiku_params(name, tree, dtype):
    """Reference params {query_norm: {...}, feat_2d_weights, attention: {...}} -> Haiku's layout.

    LayerNorm params in float32 (float64) as the module creates them; the rest in `dtype`.
    """
    norm_dtype = jnp.promote_types(dtype, jnp.float32)
    params = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            cast = norm_dtype if key.endswith("norm") else dtype
            params[f"{name}/{key}"] = {k: jnp.asarray(v, cast) for k, v in value.items()}
        else:
            params.setdefault(name, {})[key] = jnp.asarray(value, dtype)
    return params


def _reference_params(haiku_params, name):
    """Haiku params -> the reference's nested dict, float64 of exactly the values used."""
    tree = {}
    for scope, named in as_f64(haiku_params).items():
        if scope == name:
            tree.update(named)
        else:
            tree[scope[len(name) + 1 :]] = named
    return tree


def _mask(rng, shape, dtype):
    """0/1 mask with one fully masked row (index 1) and one fully masked column (index 2)."""
    mask = (rng.random(shape) > 0.25).astype(np.float64)
    mask[..., 1, :] = 0.0
    mask[..., :, 2] = 0.0
    return jnp.asarray(mask, dtype), mask


def _problem(variant, dtype, seed=0, mask_dtype=None):
    """(haiku params, inputs), (reference params, float64 inputs) for one variant."""
    module_cls, _, _, make_params = VARIANTS[variant]
    rng = np.random.default_rng(seed)
    triangle = module_cls is ga.TriangleAttention
    act, act64 = rand(rng, (R, R, C_Z) if triangle else (S, R, C_M), dtype)
    mask, mask64 = _mask(rng, act.shape[:-1], mask_dtype or dtype)
    inputs, inputs64 = [act, mask], [act64, mask64]
    if module_cls is ga.MSARowAttentionWithPairBias:
        pair, pair64 = rand(rng, (R, R, C_Z), dtype)
        inputs.append(pair)
        inputs64.append(pair64)
    haiku_name = _default_name(module_cls)
    params = _haiku_params(haiku_name, make_params(rng), dtype)
    return (params, inputs), (_reference_params(params, haiku_name), inputs64)


def _default_name(module_cls):
    return {
        ga.MSARowAttentionWithPairBias: "msa_row_attention_with_pair_bias",
        ga.MSAColumnAttention: "msa_column_attention",
        ga.MSAColumnGlobalAttention: "msa_column_global_attention",
        ga.TriangleAttention: "triangle_attention",
    }[module_cls]


# --------------------------------------------------------------------------------------------
# Forward against the float64 reference.


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_family_matches_reference(variant, dtype):
    module_cls, config, ref_fn, _ = VARIANTS[variant]
    mask_dtype = bool if dtype == "bfloat16" else None  # AF2's float masks; bool works too
    (params, inputs), (params64, inputs64) = _problem(variant, dtype, mask_dtype=mask_dtype)
    out = jax.jit(_transform(module_cls, config).apply)(params, *inputs)
    assert out.dtype == jnp.dtype(dtype) and out.shape == inputs[0].shape
    assert bool(jnp.isfinite(out.astype(jnp.float32)).all())  # fully masked rows and columns
    expected = ref_fn(params64, *inputs64)
    assert_close(out, expected, reference.tolerance(dtype, family=True))
    assert np.abs(expected).max() > 0.3  # a real update, not a vanishing one


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", ["msa_row", "triangle_start", "triangle_end"])
def test_the_pair_bias_reaches_the_op_in_the_activations_dtype(variant, dtype, monkeypatch):
    """AF2's bfloat16 modules make a bfloat16 bias; a float32 one would double what a GPU kernel
    reads of it for every batch row."""
    from gated_attention.attention import api

    seen, as_biases = [], api._as_biases
    monkeypatch.setattr(
        api, "_as_biases", lambda *a, **k: seen.append(as_biases(*a, **k)) or seen[-1]
    )
    module_cls, config, _, _ = VARIANTS[variant]
    (params, inputs), _ = _problem(variant, dtype)
    jax.make_jaxpr(_transform(module_cls, config).apply)(params, *inputs)
    assert seen and all(b.dtype == jnp.dtype(dtype) for biases in seen for b in biases), seen


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_family_runs_every_implementation(implementation):
    (params, inputs), (params64, inputs64) = _problem("triangle_end", "float32", seed=1)
    global_config = dict(GLOBAL, attention_implementation=implementation)
    module = _transform(ga.TriangleAttention, COLUMN, global_config)
    with ga.record_implementation_choices() as choices:
        out = jax.jit(module.apply)(params, *inputs)
    assert {c["chosen"] for c in choices} == {implementation}
    expected = VARIANTS["triangle_end"][2](params64, *inputs64)
    assert_close(out, expected, reference.tolerance("float32", family=True))


# 4 pair rows per bias tile (pair_bias.tile_rows: 96 * R * C_Z bytes a row): R = 6 rows run
# as a full tile and a remainder of 2, in the forward and in the backward's in-place accumulation.
BIAS_TILES = dict(GLOBAL, memory_budget_mib=4 * 96 * R * C_Z / 2**20)


@pytest.mark.parametrize("global_config, examples", [(GLOBAL, 0), (BIAS_TILES, 2)])
def test_gradients_match_reference(global_config, examples):
    """Parameter and pair gradients of TriangleAttention (ending node) against the float64
    reference: in one piece, and with the pair bias in row tiles under two leading examples (the
    bias's cotangent added into the attention's pair cotangent tile by tile, under hk.vmap)."""
    problems = [_problem("triangle_end", "float32", 3 + i) for i in range(max(examples, 1))]
    (params, _), (params64, _) = problems[0]
    pairs, masks = ([p[0][1][j] for p in problems] for j in (0, 1))
    pairs64, masks64 = ([p[1][1][j] for p in problems] for j in (0, 1))
    pair, mask = (jnp.stack(x) if examples else x[0] for x in (pairs, masks))
    module = _transform(ga.TriangleAttention, COLUMN, global_config)

    def loss(params, pair):
        return jnp.sum(jnp.sin(module.apply(params, pair, mask)))

    def ref_loss(params, pair, mask):
        out = reference.triangle_attention(params, pair, mask, orientation="per_column", xp=jnp)
        return jnp.sum(jnp.sin(out))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, pair)
    ref_params, ref_pairs = None, []
    with jax.enable_x64(True):
        ref_grad = jit_reference(jax.grad(ref_loss, argnums=(0, 1)))
        for pair64, mask64 in zip(pairs64, masks64, strict=True):
            g_params, g_pair = ref_grad(params64, pair64, mask64)
            ref_params = (
                g_params if ref_params is None else jax.tree.map(jnp.add, ref_params, g_params)
            )
            ref_pairs.append(g_pair)
    ref_pair = np.stack(ref_pairs) if examples else ref_pairs[0]
    assert_close(grads[1], ref_pair, reference.grad_tolerance("float32", ref_pair))
    ours = _reference_params(grads[0], "triangle_attention")
    jax.tree.map(
        lambda g, r: assert_close(g, r, reference.grad_tolerance("float32", r)), ours, ref_params
    )
    assert all(bool(jnp.any(g != 0)) for g in jax.tree.leaves(grads[0]))


def test_extra_leading_axes_match_reference_per_example():
    (params, (msa, mask, pair)), _ = _problem("msa_row", "float32")
    rng = np.random.default_rng(5)
    msa2, msa64 = rand(rng, (2, S, R, C_M), "float32")
    pair2, pair64 = rand(rng, (2, R, R, C_Z), "float32")
    mask2, mask64 = _mask(rng, (2, S, R), "float32")
    col_params, _ = _problem("msa_column", "float32", seed=6)[0]

    def forward(msa, mask, pair):
        row = ga.MSARowAttentionWithPairBias(ROW, GLOBAL)(msa, mask, pair)
        return row, ga.MSAColumnAttention(COLUMN, GLOBAL)(msa, mask)

    out_row, out_col = jax.jit(hk.without_apply_rng(hk.transform(forward)).apply)(
        {**params, **col_params}, msa2, mask2, pair2
    )
    row64 = _reference_params(params, "msa_row_attention_with_pair_bias")
    col64 = _reference_params(col_params, "msa_column_attention")
    tol = reference.tolerance("float32", family=True)
    for i in range(2):  # each example with its own pair bias
        expected = reference.msa_row_attention_with_pair_bias(row64, msa64[i], mask64[i], pair64[i])
        assert_close(out_row[i], expected, tol)
        assert_close(out_col[i], reference.msa_column_attention(col64, msa64[i], mask64[i]), tol)


# --------------------------------------------------------------------------------------------
# Parameters: AF2's names, shapes, dtypes and initializers.

AF2_SHAPES = {  # c_m = 8, c_z = 6, 2 heads: per-head channels 4 (MSA) and 3 (pair)
    "msa_row_attention_with_pair_bias": {"feat_2d_weights": (C_Z, H)},
    "msa_row_attention_with_pair_bias/query_norm": {"scale": (C_M,), "offset": (C_M,)},
    "msa_row_attention_with_pair_bias/feat_2d_norm": {"scale": (C_Z,), "offset": (C_Z,)},
    "msa_column_attention/query_norm": {"scale": (C_M,), "offset": (C_M,)},
    "msa_column_global_attention/query_norm": {"scale": (C_M,), "offset": (C_M,)},
    "triangle_attention_ending_node": {"feat_2d_weights": (C_Z, H)},
    "triangle_attention_ending_node/query_norm": {"scale": (C_Z,), "offset": (C_Z,)},
}
for _scope, _c in (
    ("msa_row_attention_with_pair_bias", C_M),
    ("msa_column_attention", C_M),
    ("triangle_attention_ending_node", C_Z),
):
    AF2_SHAPES[f"{_scope}/attention"] = {
        "query_w": (_c, H, _c // H),
        "key_w": (_c, H, _c // H),
        "value_w": (_c, H, _c // H),
        "gating_w": (_c, H, _c // H),
        "gating_b": (H, _c // H),
        "output_w": (H, _c // H, _c),
        "output_b": (_c,),
    }
AF2_SHAPES["msa_column_global_attention/attention"] = {
    **AF2_SHAPES["msa_column_attention/attention"],
    "key_w": (C_M, C_M // H),
    "value_w": (C_M, C_M // H),
}


def _all_four(global_config=GLOBAL, triangle_name="triangle_attention_ending_node"):
    def forward(msa, mask, pair, pair_mask):
        return (
            ga.MSARowAttentionWithPairBias(ROW, global_config)(msa, mask, pair),
            ga.MSAColumnAttention(COLUMN, global_config)(msa, mask),
            ga.MSAColumnGlobalAttention(COLUMN, global_config)(msa, mask),
            ga.TriangleAttention(COLUMN, global_config, name=triangle_name)(pair, pair_mask),
        )

    return hk.without_apply_rng(hk.transform(forward))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_param_names_shapes_and_dtypes_are_af2s(dtype):
    rng = np.random.default_rng(0)
    msa, pair = rand(rng, (S, R, C_M), dtype)[0], rand(rng, (R, R, C_Z), dtype)[0]
    shapes = jax.eval_shape(
        _all_four().init, jax.random.PRNGKey(0), msa, jnp.ones((S, R)), pair, jnp.ones((R, R))
    )
    assert jax.tree.map(lambda x: x.shape, shapes) == AF2_SHAPES
    for scope, named in shapes.items():
        for name, x in named.items():
            # AF2's LayerNorm computes in float32 for bfloat16 inputs, its params float32 too.
            want = "float32" if scope.endswith("norm") else dtype
            assert x.dtype == jnp.dtype(want), (scope, name, x.dtype)


def test_initializers_are_af2s():
    c_z, heads = 128, 4  # enough feat_2d_weights entries to estimate their stddev
    pair = jnp.asarray(np.random.default_rng(0).normal(size=(3, 3, c_z)), jnp.float32)
    module = _transform(ga.TriangleAttention, dict(num_head=heads), dict(zero_init=True))
    params = jax.jit(module.init)(jax.random.PRNGKey(1), pair, jnp.ones((3, 3)))
    norm = params["triangle_attention/query_norm"]
    np.testing.assert_array_equal(norm["scale"], np.ones(c_z))
    np.testing.assert_array_equal(norm["offset"], np.zeros(c_z))
    w = np.asarray(params["triangle_attention"]["feat_2d_weights"])
    assert abs(w.std() / (1 / np.sqrt(c_z)) - 1) < 0.15 and abs(w.mean()) < 0.02
    inner = params["triangle_attention/attention"]
    assert np.all(np.asarray(inner["output_w"]) == 0) and np.all(np.asarray(inner["gating_b"]) == 1)


# --------------------------------------------------------------------------------------------
# Errors: a ValueError/TypeError naming the argument.

msa_ones, pair_ones = jnp.ones((S, R, C_M)), jnp.ones((R, R, C_Z))
FAMILY_ERRORS = {
    "msa_act rank": (
        ga.MSAColumnAttention,
        COLUMN,
        (jnp.ones((R, C_M)), jnp.ones((R,))),
        ValueError,
        r"msa_act must have rank >= 3 \(\[\.\.\., N_seq, N_res, c_m\]\), got shape \(6, 8\)",
    ),
    "msa_act int": (
        ga.MSAColumnGlobalAttention,
        COLUMN,
        (jnp.ones((S, R, C_M), jnp.int32), jnp.ones((S, R))),
        TypeError,
        r"msa_act must be a floating-point array, got dtype int32",
    ),
    "msa_act float8": (  # the family's argument named, not Attention's q_data
        ga.MSAColumnAttention,
        COLUMN,
        (jnp.ones((S, R, C_M), jnp.float8_e4m3fn), jnp.ones((S, R))),
        TypeError,
        r"msa_act must be a floating-point array of at least 16 bits, got dtype float8_e4m3fn",
    ),
    "msa_mask shape": (
        ga.MSARowAttentionWithPairBias,
        ROW,
        (msa_ones, jnp.ones((R, S)), pair_ones),
        ValueError,
        r"msa_mask of shape \(6, 5\) must be msa_act's shape without channels, \(5, 6\)",
    ),
    "msa_mask dtype": (
        ga.MSAColumnAttention,
        COLUMN,
        (msa_ones, jnp.ones((S, R), jnp.complex64)),
        TypeError,
        r"msa_mask must be a float 0/1 \(or bool\) mask, got dtype complex64",
    ),
    "pair_act residues": (
        ga.MSARowAttentionWithPairBias,
        ROW,
        (msa_ones, jnp.ones((S, R)), jnp.ones((R + 1, R + 1, C_Z))),
        ValueError,
        r"pair_act of shape \(7, 7, 6\) must be \[\.\.\., N_res, N_res, c_z\] with msa_act's "
        r"leading axes and N_res: \(6, 6\)",
    ),
    "pair_act rank": (
        ga.MSARowAttentionWithPairBias,
        ROW,
        (msa_ones, jnp.ones((S, R)), jnp.ones((R, C_Z))),
        ValueError,
        r"pair_act must have rank >= 3",
    ),
    "pair_act bool": (
        ga.MSARowAttentionWithPairBias,
        ROW,
        (msa_ones, jnp.ones((S, R)), jnp.ones((R, R, C_Z), bool)),
        TypeError,
        r"pair_act must be a floating-point array, got dtype bool",
    ),
    "triangle not square": (
        ga.TriangleAttention,
        ROW,
        (jnp.ones((R, R + 1, C_Z)), jnp.ones((R, R + 1))),
        ValueError,
        r"pair_act of shape \(6, 7, 6\) must be square",
    ),
    "pair_mask shape": (
        ga.TriangleAttention,
        COLUMN,
        (pair_ones, jnp.ones((R, R, 1))),
        ValueError,
        r"pair_mask of shape \(6, 6, 1\) must be pair_act's shape without channels, \(6, 6\)",
    ),
    "row orientation": (
        ga.MSARowAttentionWithPairBias,
        COLUMN,
        (msa_ones, jnp.ones((S, R)), pair_ones),
        ValueError,
        r"config.orientation must be 'per_row' for MSARowAttentionWithPairBias \(as in AF2's "
        r"config\), got 'per_column'",
    ),
    "column orientation": (
        ga.MSAColumnAttention,
        ROW,
        (msa_ones, jnp.ones((S, R))),
        ValueError,
        r"config.orientation must be 'per_column' for MSAColumnAttention",
    ),
    "global orientation": (
        ga.MSAColumnGlobalAttention,
        ROW,
        (msa_ones, jnp.ones((S, R))),
        ValueError,
        r"config.orientation must be 'per_column' for MSAColumnGlobalAttention",
    ),
    "triangle orientation": (
        ga.TriangleAttention,
        dict(num_head=H, orientation="diagonal"),
        (pair_ones, jnp.ones((R, R))),
        ValueError,
        r"config.orientation must be one of \('per_row', 'per_column'\), got 'diagonal'",
    ),
}


@pytest.mark.parametrize("case", list(FAMILY_ERRORS))
def test_family_errors(case):
    module_cls, config, inputs, error, match = FAMILY_ERRORS[case]
    with pytest.raises(error, match=match):
        jax.eval_shape(_transform(module_cls, config).init, jax.random.PRNGKey(0), *inputs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rate=1.0), r"rate must be a number in \[0, 1\), got 1.0"),
        (dict(rate=-0.1), r"rate must be a number in \[0, 1\), got -0.1"),
        (dict(broadcast_dim=3), r"broadcast_dim=3 is out of range for a tensor of shape \(2, 3\)"),
    ],
)
def test_apply_dropout_errors(kwargs, match):
    kwargs = dict(dict(rate=0.5), **kwargs)
    with pytest.raises(ValueError, match=match):
        ga.apply_dropout(jnp.ones((2, 3)), is_training=True, rng=jax.random.PRNGKey(0), **kwargs)


@pytest.mark.parametrize("size", ["big", 0, 2.0, True])
def test_subbatch_size_errors(size):
    q = jnp.ones((3, 4, 8))
    attention = hk.transform(
        lambda q: ga.Attention(dict(num_head=2), {}, 8)(q, q, subbatch_size=size)
    )
    with pytest.raises(ValueError, match=r"subbatch_size must be None, 'auto' or an int >= 1, got"):
        jax.eval_shape(attention.init, jax.random.PRNGKey(0), q)


# --------------------------------------------------------------------------------------------
# Dropout.


def test_dropout_statistics():
    rate = 0.25
    x = jnp.ones((400, 500), jnp.float32)
    out = jax.jit(lambda x, key: ga.apply_dropout(x, rate, True, rng=key))(x, jax.random.PRNGKey(0))
    kept = np.asarray(out) != 0
    assert abs(kept.mean() - (1 - rate)) < 0.005  # 200,000 draws: stddev ~0.001
    np.testing.assert_array_equal(np.asarray(out)[kept], np.float32(1 / (1 - rate)))
    assert abs(float(out.mean()) - 1.0) < 0.01  # the mean is preserved
    # Not training or rate 0: the tensor itself.
    assert ga.apply_dropout(x, rate, False) is x and ga.apply_dropout(x, 0.0, True) is x


def _dropout(config, global_config, is_training):
    update = jnp.asarray(np.random.default_rng(0).normal(size=(30, 40, 8)), jnp.float32)
    run = jax.jit(lambda u, key: ga.dropout_update(config, global_config, u, is_training, rng=key))
    return update, run(update, jax.random.PRNGKey(1))


@pytest.mark.parametrize(
    "orientation, shared, axis",
    [("per_row", True, 0), ("per_column", True, 1), ("per_row", False, None)],
)
def test_dropout_update_shares_the_mask_along_the_orientation_axis(orientation, shared, axis):
    config = dict(num_head=H, orientation=orientation, dropout_rate=0.4, shared_dropout=shared)
    update, out = _dropout(config, dict(deterministic=False), is_training=True)
    kept = np.asarray(out) != 0
    np.testing.assert_allclose(np.asarray(out)[kept], np.asarray(update)[kept] / 0.6, rtol=1e-6)
    assert 0.5 < kept.mean() < 0.7
    if axis is None:  # independent entries: rows differ
        assert not np.all(kept == kept[:1]) and not np.all(kept == kept[:, :1])
    else:  # one mask shared by every index along `axis`, different along the other
        assert np.all(kept == kept.take([0], axis=axis))
        assert not np.all(kept == kept.take([0], axis=1 - axis))


@pytest.mark.parametrize(
    "global_config, is_training, applied",
    [
        (dict(deterministic=False), False, False),  # inference
        (dict(deterministic=True), True, False),  # deterministic: rate 0
        (dict(deterministic=False, eval_dropout=True), False, True),  # AF2's eval_dropout
    ],
)
def test_dropout_update_follows_af2s_rules(global_config, is_training, applied):
    config = dict(num_head=H, dropout_rate=0.4)
    update, out = _dropout(config, global_config, is_training)
    assert np.array_equal(np.asarray(out), np.asarray(update)) != applied


def test_dropout_wrapper_adds_the_dropped_update():
    (params, (msa, mask, pair)), _ = _problem("msa_row", "float32")
    config = dict(ROW, dropout_rate=0.5)
    global_config = dict(GLOBAL, deterministic=False)

    def forward(msa, mask, pair):
        module = ga.MSARowAttentionWithPairBias(config, global_config)
        update = module(msa, mask, pair, is_training=True)
        new = ga.dropout_wrapper(module, msa, mask, pair, is_training=True)  # hk.next_rng_key
        return update, new

    update, new = jax.jit(hk.transform(forward).apply)(
        params, jax.random.PRNGKey(0), msa, mask, pair
    )
    delta, update = np.asarray(new - msa), np.asarray(update)
    dropped = np.all(delta == 0, axis=(0,))  # per_row, shared: whole [r, c] entries alike
    assert dropped.any() and not dropped.all()
    np.testing.assert_allclose(delta[:, ~dropped], 2 * update[:, ~dropped], rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------
# Row tiles: the module's whole forward runs in pieces; results equal up to rounding.


def test_subbatching_gives_identical_results_under_jit():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(7, 5, 8)), jnp.float32)  # batch 7: remainders for 2, 3, 4
    mask = jnp.asarray(rng.random((7, 1, 1, 5)) > 0.3)
    bias = jnp.asarray(rng.normal(size=(2, 5, 5)), jnp.float32)
    q_mask = jnp.asarray(rng.random((7, 5, 1)) > 0.3)
    sizes = (None, 16)
    # The tiling rule (modules.rows_per_tile) on a 7,680-byte budget, half of it for a tile, 2
    # heads of 4 channels, 5 positions. Attention per row: AF2's dense working set 1,200 bytes,
    # ours in a training step 3,840. GlobalAttention: 640 and 1,920. A tile holds
    # max(3,840, subbatch_size * AF2's) // ours rows: Attention 1 row up to subbatch_size 6, 2 at
    # 7, 5 at 16; GlobalAttention 2 rows up to 7, 5 at 16 (None: the budget alone). One implementation for every size:
    # 'auto' could pick another for the whole batch than for a piece of it, and the results
    # would then differ by rounding.
    global_config = dict(
        zero_init=False, memory_budget_mib=7680 / 2**20, attention_implementation="xla"
    )

    def forward(x, mask, bias, q_mask):
        attention = ga.Attention(dict(num_head=2), global_config, 8)
        glob = ga.GlobalAttention(dict(num_head=2), global_config, 8)
        return [
            (attention(x, x, mask, bias, subbatch_size=s), glob(x, x, q_mask, subbatch_size=s))
            for s in sizes
        ]

    transformed = hk.without_apply_rng(hk.transform(forward))
    params = jax.jit(transformed.init)(jax.random.PRNGKey(0), x, mask, bias, q_mask)
    with ga.record_implementation_choices() as choices:
        outs = jax.jit(transformed.apply)(params, x, mask, bias, q_mask)
    traced_batches = [c["query"][0] for c in choices]
    # Per size, Attention then GlobalAttention: full pieces (one loop body) then the remainder.
    one, two, five = [1], [2, 1], [5, 2]  # (subbatch_size 4 tiles as None: test_modules' rule)
    expected = [one, two, five, five]
    assert traced_batches == [b for batches in expected for b in batches]
    # The whole forward runs per subbatch (bounded memory, as AF2's subbatching of the module), so
    # the projections' matmuls see fewer rows: equal up to float32 rounding, not bit for bit.
    for out in outs[1:]:
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-6), out, outs[0]
        )


def test_family_tiles_by_memory_bound():
    """The family modules' row tiles (modules.rows_per_tile), in inference and in training. R = 6
    rows of 6 positions, 2 heads of 3: AF2's dense row takes 1,296 bytes, ours 3,456; a budget of
    6,912 bytes leaves 3,456 to a tile: one row, or two where AF2's subbatch_size 6 rows (7,776
    bytes) allow it. In training AF2 never subbatches (its low_memory=not is_training): the
    budget alone bounds the tiles."""
    (params, inputs), _ = _problem("triangle_start", "float32")
    tiny = dict(GLOBAL, memory_budget_mib=6912 / 2**20)
    cases = [  # (global_config, is_training, batch of each traced op call)
        (dict(tiny, subbatch_size=None), False, [1]),
        (dict(tiny, subbatch_size=4), False, [1]),
        (dict(tiny, subbatch_size=6), False, [2]),
        (dict(tiny, subbatch_size=6), True, [1]),
        (GLOBAL, False, [R]),  # the default budget (256 MiB): all rows at once
        (dict(GLOBAL, subbatch_size="auto"), True, [R]),
    ]
    for global_config, is_training, expected in cases:
        module = _transform(ga.TriangleAttention, ROW, global_config, is_training=is_training)
        with ga.record_implementation_choices() as choices:
            jax.eval_shape(module.apply, params, *inputs)
        # The CPU's calls: where JAX's CUDA plugin is installed a GPU branch is traced too.
        on_cpu = [c["query"][0] for c in choices if c["platform"] == "cpu"]
        assert on_cpu == expected, global_config


# --------------------------------------------------------------------------------------------
# AF2 checkpoints: model_1's Evoformer attention, 48 stacked blocks.

EVO = "alphafold/alphafold_iteration/evoformer/evoformer_iteration"
LAYERS, AF2_C_M, AF2_C_Z = 48, 256, 128


def _model_1_checkpoint(path):
    """48 stacked blocks of model_1's shapes; block l holds the base params times (1 + l / 1000)."""
    rng = np.random.default_rng(0)
    blocks = {
        "msa_row_attention_with_pair_bias": reference.random_msa_row_attention_params(
            rng, AF2_C_M, AF2_C_Z, 8
        ),
        "msa_column_attention": reference.random_msa_column_attention_params(rng, AF2_C_M, 8),
        "triangle_attention_starting_node": reference.random_triangle_attention_params(
            rng, AF2_C_Z, 4
        ),
        "triangle_attention_ending_node": reference.random_triangle_attention_params(
            rng, AF2_C_Z, 4
        ),
    }
    scale = (1 + np.arange(LAYERS) / 1000).astype(np.float32)
    stacked = {}
    for name, tree in blocks.items():
        for scope, named in _haiku_params(name, tree, jnp.float32).items():
            stacked[scope] = {
                k: np.asarray(v)[None] * scale.reshape((LAYERS,) + (1,) * v.ndim)
                for k, v in named.items()
            }
    params_lib.save_af2_params(stacked, path, prefix=EVO)
    return path


def test_af2_model_1_checkpoint_loads_checks_and_applies(tmp_path):
    path = _model_1_checkpoint(tmp_path / "params_model_1.npz")
    layer = 29
    loaded = params_lib.load_af2_params(path, prefix=EVO, layer=layer)
    assert loaded["msa_row_attention_with_pair_bias/attention"]["query_w"].shape == (256, 8, 32)

    rng = np.random.default_rng(1)
    msa, msa64 = rand(rng, (3, 4, AF2_C_M), "float32")
    pair, pair64 = rand(rng, (4, 4, AF2_C_Z), "float32")
    mask, mask64 = _mask(rng, (3, 4), "float32")
    pair_mask, pair_mask64 = _mask(rng, (4, 4), "float32")

    def forward(msa, mask, pair, pair_mask):
        return (
            ga.MSARowAttentionWithPairBias(dict(num_head=8), {})(msa, mask, pair),
            ga.MSAColumnAttention(dict(num_head=8, orientation="per_column"), {})(msa, mask),
            ga.TriangleAttention(dict(num_head=4), {}, name="triangle_attention_starting_node")(
                pair, pair_mask
            ),
            ga.TriangleAttention(
                dict(num_head=4, orientation="per_column"),
                {},
                name="triangle_attention_ending_node",
            )(pair, pair_mask),
        )

    transformed = hk.without_apply_rng(hk.transform(forward))
    inputs = (msa, mask, pair, pair_mask)
    params_lib.check_params(
        loaded, jax.eval_shape(transformed.init, jax.random.PRNGKey(0), *inputs)
    )
    row, column, start, end = jax.jit(transformed.apply)(loaded, *inputs)

    def ref(name):
        return _reference_params({k: v for k, v in loaded.items() if k.split("/")[0] == name}, name)

    tol = reference.tolerance("float32", family=True)
    assert_close(
        row,
        reference.msa_row_attention_with_pair_bias(
            ref("msa_row_attention_with_pair_bias"), msa64, mask64, pair64
        ),
        tol,
    )
    assert_close(
        column, reference.msa_column_attention(ref("msa_column_attention"), msa64, mask64), tol
    )
    for out, name, orientation in (
        (start, "triangle_attention_starting_node", "per_row"),
        (end, "triangle_attention_ending_node", "per_column"),
    ):
        expected = reference.triangle_attention(
            ref(name), pair64, pair_mask64, orientation=orientation
        )
        assert_close(out, expected, tol)
    # Block 29's values, not another block's.
    np.testing.assert_allclose(
        loaded["msa_column_attention/attention"]["output_b"],
        params_lib.load_af2_params(path, prefix=EVO, layer=0)["msa_column_attention/attention"][
            "output_b"
        ]
        * np.float32(1 + layer / 1000),
        rtol=1e-6,
    )


def test_training_step_holds_no_pair_sized_temporary():
    """TriangleAttention's training step (the update's cotangent an argument) in row tiles: XLA's
    temporaries stay under half the pair's size. The row loop's backward reads the cotangent in
    place (copying it to zero slices would add one pair: 2.1x) and the pair bias's gradient is
    added into the attention's tile by tile (summing the two whole would add one: 1.2x)."""
    r, c = 128, 64
    config = dict(num_head=2, orientation="per_row")
    global_config = dict(zero_init=False, memory_budget_mib=1.0)  # 1-row tiles in both loops
    module = hk.without_apply_rng(
        hk.transform(lambda p, m: ga.TriangleAttention(config, global_config)(p, m, True))
    )
    pair, mask = jnp.ones((r, r, c)), jnp.ones((r, r))
    params = jax.eval_shape(module.init, jax.random.PRNGKey(0), pair, mask)

    def step(params, pair, cotangent):
        _, vjp = jax.vjp(lambda p, x: module.apply(p, x, mask), params, pair)
        return vjp(cotangent)

    with ga.record_implementation_choices() as choices:
        compiled = jax.jit(step).lower(params, pair, pair).compile()
    assert {c["query"][0] for c in choices} == {1}  # the attention's tiles: one pair row each
    assert compiled.memory_analysis().temp_size_in_bytes <= pair.nbytes // 2


def _reference_with(variant, xp):
    """The variant's float64 reference over `xp` (jnp: differentiable)."""
    fns = dict(
        msa_row=lambda p, m, mask, z: reference.msa_row_attention_with_pair_bias(p, m, mask, z, xp=xp),
        msa_column=lambda p, m, mask: reference.msa_column_attention(p, m, mask, xp=xp),
        triangle_start=lambda p, z, mask: reference.triangle_attention(p, z, mask, orientation="per_row", xp=xp),
        triangle_end=lambda p, z, mask: reference.triangle_attention(p, z, mask, orientation="per_column", xp=xp),
    )  # fmt: skip
    return fns[variant]


@pytest.mark.parametrize(
    "variant, implementation",
    [("msa_row", "pallas"), ("msa_column", "pallas"), ("triangle_start", "xla"),
     ("triangle_end", "pallas")],
)  # fmt: skip
def test_one_pass_modules_hand_the_op_one_packed_projection(variant, implementation, monkeypatch):
    """Where a module is one pass (a GPU, one call: modules.reads_in_place, made true here on
    the CPU) each family module projects q, k and v as one packed array that the op reads as it
    lies (packed_dot_product_attention), the column modules positions first with the bias of the
    pair transposed: values and gradients against the float64 reference, with the Triton kernel
    (interpreted) reading the slots and columns in place and XLA given the slices (the Mosaic
    kernel's in-place reads: tests/attention/test_positions_first.py)."""
    from gated_attention.af2 import modules
    from gated_attention.attention import base, dispatch

    interpreted = dict(pallas=ga.PallasAttention(block_q=16, block_k=16, interpret=True))
    if implementation in interpreted:
        table = {**dispatch.IMPLEMENTATIONS, implementation: interpreted[implementation]}
        monkeypatch.setattr(dispatch, "IMPLEMENTATIONS", table)
    monkeypatch.setattr(modules, "reads_in_place", lambda kind, rows: rows is None)
    layouts, run = [], base.run
    monkeypatch.setattr(base, "run", lambda *a, **k: layouts.append(k["options"]) or run(*a, **k))
    module_cls, config, ref_fn, _ = VARIANTS[variant]
    (params, inputs), (params64, inputs64) = _problem(variant, "float32", seed=2)
    global_config = dict(GLOBAL, subbatch_size=None, attention_implementation=implementation)
    module = _transform(module_cls, config, global_config)
    name = _default_name(module_cls)
    ref_with = _reference_with(variant, jnp)

    def loss(params, act):
        return jnp.sum(jnp.sin(module.apply(params, act, *inputs[1:])))

    def ref_loss(params, act, *rest):
        return jnp.sum(jnp.sin(ref_with(params, act, *rest)))

    out = jax.jit(module.apply)(params, *inputs)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, inputs[0])
    assert layouts and all(o.packed for o in layouts)
    assert all(o.positions_first == (config is COLUMN) for o in layouts)
    assert_close(out, ref_fn(params64, *inputs64), reference.tolerance("float32", family=True))
    with jax.enable_x64(True):
        ref_params, ref_act = jit_reference(jax.grad(ref_loss, argnums=(0, 1)))(params64, *inputs64)
    assert_close(grads[1], ref_act, reference.grad_tolerance("float32", ref_act))
    jax.tree.map(
        lambda g, r: assert_close(g, r, reference.grad_tolerance("float32", r)),
        _reference_params(grads[0], name),
        ref_params,
    )
