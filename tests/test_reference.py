"""Proves tests/reference.py right, independently of the package.

Every reference function is compared against a slow, obviously-correct implementation written here
with Python loops over batch, head and query positions and math on scalars and vectors. The jax.numpy
path of the reference is checked against the NumPy path, and its jax.grad against central finite
differences, all in float64.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import reference as ref
from tests.helpers import jit_reference

# ------------------------------------------------------------------------------------------------
# Loop implementations: one query, one head at a time
# ------------------------------------------------------------------------------------------------


def loop_softmax(row):
    """Softmax of a 1-D sequence with Python scalars."""
    top = max(row)
    exps = [math.exp(x - top) for x in row]
    total = sum(exps)
    return [e / total for e in exps]


def loop_sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def loop_layer_norm(x, scale, offset, eps=1e-5):
    """LayerNorm of every vector along the last axis, one vector at a time."""
    out = np.zeros_like(x)
    for idx in np.ndindex(x.shape[:-1]):
        vec = x[idx]
        n = vec.shape[0]
        mu = sum(vec) / n
        var = sum((e - mu) ** 2 for e in vec) / n
        out[idx] = (vec - mu) / math.sqrt(var + eps) * scale + offset
    return out


def loop_dot_product_attention(query, key, value, bias=None, mask=None, scale=None):
    """query [B, T, N, H], key [B, S, N, H], value [B, S, N, Hv] -> [B, T, N, Hv]."""
    nb, nt, nn, nh = query.shape
    ns, nv = key.shape[1], value.shape[-1]
    scale = nh**-0.5 if scale is None else scale
    full = (nb, nn, nt, ns)
    bias = np.zeros(full) if bias is None else np.broadcast_to(bias, full)
    mask = np.ones(full, bool) if mask is None else np.broadcast_to(mask, full)
    out = np.zeros((nb, nt, nn, nv))
    for b in range(nb):
        for n in range(nn):
            for t in range(nt):
                logits = []
                for s in range(ns):
                    logit = scale * float(np.dot(query[b, t, n], key[b, s, n])) + bias[b, n, t, s]
                    logits.append(logit if mask[b, n, t, s] else -1e9)
                weights = loop_softmax(logits)
                out[b, t, n] = sum(w * value[b, s, n] for s, w in enumerate(weights))
    return out


def loop_attention(params, q_data, m_data, mask=None, nonbatched_bias=None, bias=None, gating=True):
    """AF2 gated attention; mask/bias already broadcastable to [b, h, q, k] (rank 4)."""
    nb, nq, _ = q_data.shape
    nk = m_data.shape[1]
    nh, _, no = params["output_w"].shape
    key_dim = params["query_w"].shape[-1]
    full = (nb, nh, nq, nk)
    mask = np.ones(full, bool) if mask is None else np.broadcast_to(mask, full)
    bias = np.zeros(full) if bias is None else np.broadcast_to(bias, full)
    nbb = (
        np.zeros((nh, nq, nk))
        if nonbatched_bias is None
        else np.broadcast_to(nonbatched_bias, (nh, nq, nk))
    )
    out = np.zeros((nb, nq, no))
    for b in range(nb):
        for i in range(nq):
            out[b, i] = params["output_b"]
            for h in range(nh):
                q_vec = q_data[b, i] @ params["query_w"][:, h, :] / math.sqrt(key_dim)
                logits = []
                for j in range(nk):
                    k_vec = m_data[b, j] @ params["key_w"][:, h, :]
                    logit = float(q_vec @ k_vec) + nbb[h, i, j] + bias[b, h, i, j]
                    logits.append(logit if mask[b, h, i, j] else -1e9)
                weights = loop_softmax(logits)
                avg = sum(
                    w * (m_data[b, j] @ params["value_w"][:, h, :]) for j, w in enumerate(weights)
                )
                if gating:
                    avg = avg * loop_sigmoid(
                        q_data[b, i] @ params["gating_w"][:, h, :] + params["gating_b"][h]
                    )
                out[b, i] += avg @ params["output_w"][h]
    return out


def loop_global_attention(params, q_data, m_data, q_mask, gating=True):
    """AF2 GlobalAttention with q_mask [b, q, 1] (0/1)."""
    nb, nq, _ = q_data.shape
    nh, _, no = params["output_w"].shape
    key_dim = params["query_w"].shape[-1]
    out = np.zeros((nb, nq, no))
    for b in range(nb):
        keep = [float(q_mask[b, i, 0] != 0) for i in range(nq)]
        q_avg = sum(keep[i] * q_data[b, i] for i in range(nq)) / (sum(keep) + 1e-10)
        avgs = []
        for h in range(nh):
            q_vec = q_avg @ params["query_w"][:, h, :] / math.sqrt(key_dim)
            logits = [
                float(q_vec @ (m_data[b, j] @ params["key_w"])) if keep[j] else -1e9
                for j in range(nq)
            ]
            weights = loop_softmax(logits)
            avgs.append(sum(w * (m_data[b, j] @ params["value_w"]) for j, w in enumerate(weights)))
        for i in range(nq):
            out[b, i] = params["output_b"]
            for h in range(nh):
                avg = avgs[h]
                if gating:
                    avg = avg * loop_sigmoid(
                        q_data[b, i] @ params["gating_w"][:, h, :] + params["gating_b"][h]
                    )
                out[b, i] += avg @ params["output_w"][h]
    return out


def loop_pair_bias(pair_normed, feat_2d_weights):
    """[r, r, z], [z, h] -> [h, r, r], one entry at a time."""
    nr = pair_normed.shape[0]
    nh = feat_2d_weights.shape[1]
    bias = np.zeros((nh, nr, nr))
    for h in range(nh):
        for i in range(nr):
            for j in range(nr):
                bias[h, i, j] = float(pair_normed[i, j] @ feat_2d_weights[:, h])
    return bias


# ------------------------------------------------------------------------------------------------
# Fixtures and helpers
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture
def x64():
    """Enables jax's float64 for one test only (leaves the global flag untouched)."""
    with jax.enable_x64(True):
        yield


def assert_close(actual, expected, tol=1e-12):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=tol, atol=tol)


def _axpy(alpha, d, x):
    """x + alpha * d over matching dicts of NumPy arrays."""
    return {k: x[k] + alpha * d[k] for k in x}


def check_grad(f_np, grads, args, rng, eps=1e-6, tol=1e-7):
    """jax.grad `grads` of f at `args` (dicts of arrays) against central differences of f_np.

    Checks <grad, d> == (f(x + eps d) - f(x - eps d)) / (2 eps) for two random directions d.
    """
    for name, g in grads.items():
        assert np.all(np.isfinite(g)), name
        assert np.max(np.abs(g)) > 1e-3, name  # an identically zero gradient proves nothing
    for _ in range(2):
        d = {k: rng.normal(size=np.shape(v)) for k, v in args.items()}
        fd = (f_np(_axpy(eps, d, args)) - f_np(_axpy(-eps, d, args))) / (2 * eps)
        directional = sum(float(np.sum(np.asarray(grads[k]) * d[k])) for k in args)
        np.testing.assert_allclose(directional, fd, rtol=tol, atol=tol)


B, Q, K, A, M, H, C, CV, OUT = 2, 3, 4, 5, 6, 2, 3, 4, 7  # all distinct where the maths allows


def _attention_inputs(rng, gating=True):
    params = ref.random_attention_params(rng, A, M, H, C, CV, OUT, gating=gating)
    return params, rng.normal(size=(B, Q, A)), rng.normal(size=(B, K, M))


# ------------------------------------------------------------------------------------------------
# softmax, layer_norm, dot_product_attention
# ------------------------------------------------------------------------------------------------


def test_softmax_matches_loop(rng):
    x = rng.normal(size=(3, 5)) * 4
    expected = np.array([loop_softmax(list(row)) for row in x])
    assert_close(ref.softmax(x), expected)
    assert_close(ref.softmax(x.T, axis=0), expected.T)


def test_softmax_is_stable_for_huge_logits(rng):
    x = rng.normal(size=(4, 6))
    assert_close(ref.softmax(x + 1e4), ref.softmax(x))
    assert_close(ref.softmax(np.full((2, 3), -1e9)), np.full((2, 3), 1 / 3))


def test_layer_norm_matches_loop(rng):
    x = rng.normal(size=(2, 3, 8)) * 3 + 1
    p = ref.random_layer_norm_params(rng, 8)
    assert_close(
        ref.layer_norm(x, p["scale"], p["offset"]), loop_layer_norm(x, p["scale"], p["offset"])
    )
    # Without scale/offset the output has zero mean and (eps-shrunk) unit biased variance.
    y = ref.layer_norm(x, np.ones(8), np.zeros(8))
    assert_close(y.mean(-1), np.zeros((2, 3)))
    assert_close(y.var(-1), x.var(-1) / (x.var(-1) + 1e-5))


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("mask_shape", [None, (2, 1, 1, 5), (2, 3, 4, 5)])
@pytest.mark.parametrize("scale", [None, 0.7])
def test_dot_product_attention_matches_loop(rng, with_bias, mask_shape, scale):
    b, t, n, h, s, hv = 2, 4, 3, 6, 5, 2
    query = rng.normal(size=(b, t, n, h))
    key = rng.normal(size=(b, s, n, h))
    value = rng.normal(size=(b, s, n, hv))
    bias = rng.normal(size=(1, n, t, s)) if with_bias else None
    mask = None if mask_shape is None else rng.random(mask_shape) > 0.3
    got = ref.dot_product_attention(query, key, value, bias=bias, mask=mask, scale=scale)
    assert got.shape == (b, t, n, hv)
    assert_close(got, loop_dot_product_attention(query, key, value, bias, mask, scale))


def test_dot_product_attention_extra_batch_axes(rng):
    query = rng.normal(size=(2, 3, 4, 2, 5))
    key = rng.normal(size=(2, 3, 6, 2, 5))
    value = rng.normal(size=(2, 3, 6, 2, 3))
    mask = rng.random((2, 3, 1, 4, 6)) > 0.3
    got = ref.dot_product_attention(query, key, value, mask=mask)
    for i in range(2):
        assert_close(got[i], loop_dot_product_attention(query[i], key[i], value[i], mask=mask[i]))


def test_dot_product_attention_fully_masked_row_is_uniform_average(rng):
    query = rng.normal(size=(1, 3, 2, 4))
    key = rng.normal(size=(1, 5, 2, 4))
    value = rng.normal(size=(1, 5, 2, 3))
    mask = np.ones((1, 2, 3, 5), bool)
    mask[0, 1, 2] = False  # head 1, query 2 sees nothing
    bias = rng.normal(size=(1, 2, 3, 5)) * 10  # masked entries are replaced, so bias is ignored
    got = ref.dot_product_attention(query, key, value, bias=bias, mask=mask)
    assert np.all(np.isfinite(got))
    assert_close(got[0, 2, 1], value[0, :, 1].mean(0))
    assert not np.allclose(got[0, 2, 0], value[0, :, 0].mean(0))  # head 0 is not uniform


# ------------------------------------------------------------------------------------------------
# attention and global_attention
# ------------------------------------------------------------------------------------------------


MASKS = {
    "none": None,
    "keys_4d": (B, 1, 1, K),
    "per_head_4d": (B, H, Q, K),
    "3d": (B, Q, K),
}


@pytest.mark.parametrize("gating", [True, False])
@pytest.mark.parametrize("mask_kind", list(MASKS))
@pytest.mark.parametrize("nbb_shape", [None, (H, Q, K), (Q, K)])
def test_attention_matches_loop(rng, gating, mask_kind, nbb_shape):
    params, q_data, m_data = _attention_inputs(rng, gating)
    shape = MASKS[mask_kind]
    mask = None if shape is None else rng.random(shape) > 0.3
    nbb = None if nbb_shape is None else rng.normal(size=nbb_shape)
    bias = rng.normal(size=(B, 1, Q, K))
    got = ref.attention(params, q_data, m_data, mask, nbb, bias, gating=gating)
    loop_mask = None if mask is None else (mask[:, None] if mask.ndim == 3 else mask)
    assert got.shape == (B, Q, OUT)
    assert_close(got, loop_attention(params, q_data, m_data, loop_mask, nbb, bias, gating))


def test_attention_float_mask_equals_bool_mask(rng):
    params, q_data, m_data = _attention_inputs(rng)
    mask = rng.random((B, 1, 1, K)) > 0.4
    assert_close(
        ref.attention(params, q_data, m_data, mask.astype(np.float32)),
        ref.attention(params, q_data, m_data, mask),
    )


def test_attention_ignores_gating_params_when_ungated(rng):
    params, q_data, m_data = _attention_inputs(rng, gating=True)
    ungated = {k: v for k, v in params.items() if not k.startswith("gating")}
    assert_close(
        ref.attention(params, q_data, m_data, gating=False),
        ref.attention(ungated, q_data, m_data, gating=False),
    )
    assert not np.allclose(
        ref.attention(params, q_data, m_data, gating=True),
        ref.attention(params, q_data, m_data, gating=False),
    )


@pytest.mark.parametrize("gating", [True, False])
def test_attention_fully_masked_row_is_uniform_average(rng, gating):
    params, q_data, m_data = _attention_inputs(rng, gating)
    mask = np.ones((B, Q, K), bool)
    mask[1, 0] = False  # batch 1, query 0 sees no key
    bias = rng.normal(size=(B, H, Q, K)) * 10  # replaced, not added, for masked entries
    got = ref.attention(params, q_data, m_data, mask, bias=bias, gating=gating)
    assert np.all(np.isfinite(got))
    mean_v = np.einsum("km,mhv->hv", m_data[1], params["value_w"]) / K  # [h, v]
    if gating:
        mean_v = mean_v * loop_sigmoid(
            np.einsum("a,ahv->hv", q_data[1, 0], params["gating_w"]) + params["gating_b"]
        )
    expected = np.einsum("hv,hvo->o", mean_v, params["output_w"]) + params["output_b"]  # [o]
    assert_close(got[1, 0], expected)


def test_attention_masked_keys_have_no_influence(rng):
    params, q_data, m_data = _attention_inputs(rng)
    mask = np.ones((B, 1, 1, K), bool)
    mask[:, :, :, 2] = False
    other = m_data.copy()
    other[:, 2] += 5.0
    assert_close(
        ref.attention(params, q_data, m_data, mask), ref.attention(params, q_data, other, mask)
    )
    assert not np.allclose(
        ref.attention(params, q_data, m_data), ref.attention(params, q_data, other)
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(mask=np.ones((Q, K), bool)), "mask"),
        (dict(nonbatched_bias=np.zeros((1, H, Q, K))), "nonbatched_bias"),
    ],
)
def test_attention_rejects_bad_ranks(rng, kwargs, match):
    params, q_data, m_data = _attention_inputs(rng)
    with pytest.raises(ValueError, match=match):
        ref.attention(params, q_data, m_data, **kwargs)
    with pytest.raises(ValueError, match="q_data"):
        ref.attention(params, q_data[0], m_data)


def _global_inputs(rng, gating=True):
    params = ref.random_global_attention_params(rng, A, M, H, C, CV, OUT, gating=gating)
    q_data = rng.normal(size=(B, Q, A))
    m_data = rng.normal(size=(B, Q, M))
    q_mask = (rng.random((B, Q, 1)) > 0.3).astype(np.float64)
    q_mask[:, 0] = 1.0  # at least one position kept
    return params, q_data, m_data, q_mask


@pytest.mark.parametrize("gating", [True, False])
def test_global_attention_matches_loop(rng, gating):
    params, q_data, m_data, q_mask = _global_inputs(rng, gating)
    got = ref.global_attention(params, q_data, m_data, q_mask, gating=gating)
    assert got.shape == (B, Q, OUT)
    assert_close(got, loop_global_attention(params, q_data, m_data, q_mask, gating))
    assert_close(ref.global_attention(params, q_data, m_data, q_mask > 0, gating=gating), got)
    if not gating:  # broadcast over queries
        assert_close(got, np.broadcast_to(got[:, :1], got.shape))


def test_global_attention_masked_positions_have_no_influence_on_others(rng):
    params, q_data, m_data, q_mask = _global_inputs(rng)
    q_mask[:, 1] = 0.0
    q_other, m_other = q_data.copy(), m_data.copy()
    q_other[:, 1] += 3.0
    m_other[:, 1] -= 3.0
    got = ref.global_attention(params, q_data, m_data, q_mask)
    changed = ref.global_attention(params, q_other, m_other, q_mask)
    keep = [0] + list(range(2, Q))  # position 1 itself keeps its own (changed) gate
    assert_close(got[:, keep], changed[:, keep])


def test_global_attention_fully_masked_is_uniform_average(rng):
    params, q_data, m_data, q_mask = _global_inputs(rng)
    q_mask[1] = 0.0
    got = ref.global_attention(params, q_data, m_data, q_mask)
    assert np.all(np.isfinite(got))
    avg = np.einsum("km,mv->v", m_data[1], params["value_w"]) / Q  # [v], same for every head
    gate = loop_sigmoid(
        np.einsum("qa,ahv->qhv", q_data[1], params["gating_w"]) + params["gating_b"]
    )  # [q, h, v]
    expected = np.einsum("qhv,hvo->qo", avg * gate, params["output_w"]) + params["output_b"]
    assert_close(got[1], expected)


# ------------------------------------------------------------------------------------------------
# AF2's attention family
# ------------------------------------------------------------------------------------------------

S, R, CM, CZ, NH = 3, 4, 6, 4, 2


def _msa(rng):
    msa_act = rng.normal(size=(S, R, CM))
    msa_mask = (rng.random((S, R)) > 0.25).astype(np.float64)
    msa_mask[1] = 0.0  # a fully masked row
    return msa_act, msa_mask


def _pair(rng):
    pair_act = rng.normal(size=(R, R, CZ))
    pair_mask = rng.random((R, R)) > 0.25
    pair_mask[:, 2] = False  # a fully masked column (and so fully masked rows after transposing)
    pair_mask[3] = False
    return pair_act, pair_mask


def test_msa_row_attention_matches_loop_composition(rng):
    params = ref.random_msa_row_attention_params(rng, CM, CZ, NH)
    msa_act, msa_mask = _msa(rng)
    pair_act, _ = _pair(rng)
    got = ref.msa_row_attention_with_pair_bias(params, msa_act, msa_mask, pair_act, NH)
    x = loop_layer_norm(msa_act, **params["query_norm"])
    z = loop_layer_norm(pair_act, **params["feat_2d_norm"])
    nbb = loop_pair_bias(z, params["feat_2d_weights"])
    expected = loop_attention(params["attention"], x, x, msa_mask[:, None, None, :] > 0, nbb)
    assert got.shape == (S, R, CM)
    assert_close(got, expected)


@pytest.mark.parametrize("gating", [True, False])
def test_msa_column_attention_is_transposed_row_attention(rng, gating):
    params = ref.random_msa_column_attention_params(rng, CM, NH, gating)
    msa_act, msa_mask = _msa(rng)
    got = ref.msa_column_attention(params, msa_act, msa_mask, NH, gating)
    # 1) transpose + LayerNorm + attention without bias + transpose, with loops.
    x = loop_layer_norm(msa_act.transpose(1, 0, 2), **params["query_norm"])
    mask = msa_mask.T[:, None, None, :] > 0
    expected = loop_attention(params["attention"], x, x, mask, gating=gating).transpose(1, 0, 2)
    assert_close(got, expected)
    # 2) row attention on the transposed MSA whose pair bias is zeroed.
    row_params = dict(
        params,
        feat_2d_norm=ref.random_layer_norm_params(rng, CZ),
        feat_2d_weights=np.zeros((CZ, NH)),
    )
    row = ref.msa_row_attention_with_pair_bias(
        row_params, msa_act.transpose(1, 0, 2), msa_mask.T, rng.normal(size=(S, S, CZ)), NH, gating
    )
    assert_close(got, row.transpose(1, 0, 2))


@pytest.mark.parametrize("gating", [True, False])
def test_msa_column_global_attention_matches_loop_composition(rng, gating):
    params = ref.random_msa_column_global_attention_params(rng, CM, NH, gating)
    msa_act, msa_mask = _msa(rng)
    msa_mask[:, 0] = 0.0  # a fully masked column
    got = ref.msa_column_global_attention(params, msa_act, msa_mask, NH, gating)
    x = loop_layer_norm(msa_act.transpose(1, 0, 2), **params["query_norm"])
    expected = loop_global_attention(params["attention"], x, x, msa_mask.T[..., None], gating)
    assert got.shape == (S, R, CM)
    assert_close(got, expected.transpose(1, 0, 2))


def test_triangle_attention_per_row_matches_loop_composition(rng):
    params = ref.random_triangle_attention_params(rng, CZ, NH)
    pair_act, pair_mask = _pair(rng)
    got = ref.triangle_attention(params, pair_act, pair_mask, NH, "per_row")
    z = loop_layer_norm(pair_act, **params["query_norm"])
    nbb = loop_pair_bias(z, params["feat_2d_weights"])
    expected = loop_attention(params["attention"], z, z, pair_mask[:, None, None, :], nbb)
    assert got.shape == (R, R, CZ)
    assert_close(got, expected)


def test_triangle_attention_per_row_is_msa_row_attention_on_the_pair(rng):
    params = ref.random_triangle_attention_params(rng, CZ, NH)
    pair_act, pair_mask = _pair(rng)
    row_params = dict(params, feat_2d_norm=params["query_norm"])
    expected = ref.msa_row_attention_with_pair_bias(row_params, pair_act, pair_mask, pair_act, NH)
    assert_close(ref.triangle_attention(params, pair_act, pair_mask, NH), expected)


@pytest.mark.parametrize("gating", [True, False])
def test_triangle_attention_per_column_is_transposed_per_row(rng, gating):
    params = ref.random_triangle_attention_params(rng, CZ, NH, gating)
    pair_act, pair_mask = _pair(rng)
    got = ref.triangle_attention(params, pair_act, pair_mask, NH, "per_column", gating)
    per_row = ref.triangle_attention(
        params, pair_act.transpose(1, 0, 2), pair_mask.T, NH, "per_row", gating
    )
    assert_close(got, per_row.transpose(1, 0, 2))
    assert not np.allclose(
        got, ref.triangle_attention(params, pair_act, pair_mask, NH, "per_row", gating)
    )


def test_family_argument_errors(rng):
    params = ref.random_triangle_attention_params(rng, CZ, NH)
    pair_act, pair_mask = _pair(rng)
    with pytest.raises(ValueError, match="orientation"):
        ref.triangle_attention(params, pair_act, pair_mask, NH, "diagonal")
    with pytest.raises(ValueError, match="num_head"):
        ref.triangle_attention(params, pair_act, pair_mask, NH + 1)
    with pytest.raises(ValueError, match="num_head"):
        ref.random_triangle_attention_params(rng, 5, 2)


# ------------------------------------------------------------------------------------------------
# The jax.numpy path: same values, working float64 gradients
# ------------------------------------------------------------------------------------------------


def _family_cases(rng):
    """name -> (fn(args, xp), args): fn is differentiated w.r.t. every array in the dict args."""
    msa_act, msa_mask = _msa(rng)
    pair_act, pair_mask = _pair(rng)
    row = ref.random_msa_row_attention_params(rng, CM, CZ, NH)
    col = ref.random_msa_column_attention_params(rng, CM, NH)
    glob = ref.random_msa_column_global_attention_params(rng, CM, NH, gating=False)
    tri = ref.random_triangle_attention_params(rng, CZ, NH)
    return {
        "msa_row": (
            lambda x, xp: ref.msa_row_attention_with_pair_bias(
                dict(row, feat_2d_weights=x["w"]), x["msa"], msa_mask, x["pair"], NH, xp=xp
            ),
            dict(msa=msa_act, pair=pair_act, w=row["feat_2d_weights"]),
        ),
        "msa_column": (
            lambda x, xp: ref.msa_column_attention(
                dict(col, query_norm=dict(scale=x["scale"], offset=col["query_norm"]["offset"])),
                x["msa"],
                msa_mask,
                NH,
                xp=xp,
            ),
            dict(msa=msa_act, scale=col["query_norm"]["scale"]),
        ),
        "msa_column_global_ungated": (
            lambda x, xp: ref.msa_column_global_attention(
                glob, x["msa"], msa_mask, NH, gating=False, xp=xp
            ),
            dict(msa=msa_act),
        ),
        "triangle_per_column": (
            lambda x, xp: ref.triangle_attention(
                tri, x["pair"], pair_mask, NH, "per_column", xp=xp
            ),
            dict(pair=pair_act),
        ),
    }


def _op_cases(rng):
    """name -> (fn(args, xp), args), like _family_cases (which cover softmax and layer_norm)."""
    params, q_data, m_data = _attention_inputs(rng)
    gparams, gq, gm, gmask = _global_inputs(rng)
    mask = rng.random((B, Q, K)) > 0.3
    mask[0, 1] = False  # a fully masked row
    nbb = rng.normal(size=(H, Q, K))
    bias = rng.normal(size=(B, H, Q, K))
    dpa = dict(
        q=rng.normal(size=(B, Q, H, C)),
        k=rng.normal(size=(B, K, H, C)),
        v=rng.normal(size=(B, K, H, CV)),
        bias=bias,
    )
    return {
        "dot_product_attention": (
            lambda x, xp: ref.dot_product_attention(
                x["q"], x["k"], x["v"], x["bias"], mask[:, None], xp=xp
            ),
            dpa,
        ),
        "attention": (
            lambda x, xp: ref.attention(
                dict(params, query_w=x["query_w"], gating_w=x["gating_w"], output_w=x["output_w"]),
                x["q"],
                x["m"],
                mask,
                x["nbb"],
                x["bias"],
                xp=xp,
            ),
            dict(
                q=q_data,
                m=m_data,
                nbb=nbb,
                bias=bias,
                query_w=params["query_w"],
                gating_w=params["gating_w"],
                output_w=params["output_w"],
            ),
        ),
        "global_attention": (
            lambda x, xp: ref.global_attention(
                dict(gparams, key_w=x["key_w"]), x["q"], x["m"], gmask, xp=xp
            ),
            dict(q=gq, m=gm, key_w=gparams["key_w"]),
        ),
    }


def _all_cases():
    rng = np.random.default_rng(1)
    return {**_op_cases(rng), **_family_cases(rng)}


CASES = _all_cases()


@pytest.mark.parametrize("name", list(CASES))
def test_jax_path_matches_numpy_and_has_correct_gradient(x64, name):
    fn, args = CASES[name]
    out_np = fn(args, np)
    cot = np.random.default_rng(2).normal(size=out_np.shape)

    @jit_reference
    def forward_and_grad(x):
        out, vjp = jax.vjp(lambda y: fn(y, jnp), x)
        return out, vjp(jnp.asarray(cot))[0]  # the gradient of sum(out * cot)

    out_jax, grads = forward_and_grad(args)
    assert out_jax.dtype == jnp.float64
    assert_close(out_jax, out_np)
    check_grad(lambda x: float(np.sum(fn(x, np) * cot)), grads, args, np.random.default_rng(3))


def test_jax_path_runs_eagerly_and_casts_float32_inputs_to_float64(x64, rng):
    params, q_data, m_data = _attention_inputs(rng)
    mask = rng.random((B, 1, 1, K)) > 0.3
    params32 = {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}
    got = ref.attention(params32, jnp.asarray(q_data, jnp.float32), m_data, mask, xp=jnp)
    assert isinstance(got, jax.Array) and got.dtype == jnp.float64
    params32_np = {k: np.asarray(v) for k, v in params32.items()}
    expected = ref.attention(params32_np, np.asarray(q_data, np.float32), m_data, mask)
    assert_close(got, expected)
    assert not np.allclose(expected, ref.attention(params, q_data, m_data, mask), rtol=0, atol=1e-9)


def test_gradient_through_fully_masked_rows_is_finite(x64, rng):
    params, q_data, m_data = _attention_inputs(rng)
    mask = np.zeros((B, 1, 1, K), bool)  # everything masked

    def loss(p):
        return jnp.sum(ref.attention(p, q_data, m_data, mask, xp=jnp) ** 2)

    grads = jit_reference(jax.grad(loss))(params)
    for name, g in grads.items():
        assert np.all(np.isfinite(g)), name
    # Uniform weights: the logits (hence query_w and key_w) get exactly zero gradient.
    assert_close(grads["query_w"], np.zeros_like(params["query_w"]))
    assert np.max(np.abs(grads["value_w"])) > 1e-3


# ------------------------------------------------------------------------------------------------
# Tolerances and parameter builders
# ------------------------------------------------------------------------------------------------


def test_tolerances_are_ordered_by_precision():
    dtypes = [np.float64, np.float32, "tf32", np.float16, jnp.bfloat16]
    rtols = [ref.tolerance(d, platform="cpu")["rtol"] for d in dtypes]
    assert rtols == sorted(rtols) and len(set(rtols)) == 5
    for d in dtypes:
        tol, fam = ref.tolerance(d, platform="cpu"), ref.tolerance(d, family=True, platform="cpu")
        grad = ref.grad_tolerance(d, platform="cpu")
        assert fam["rtol"] >= tol["rtol"] and grad["rtol"] >= tol["rtol"]
        assert grad["atol"] >= tol["atol"]
    assert ref.tolerance(np.float32, platform="cpu") == dict(rtol=1e-5, atol=1e-5)
    assert ref.tolerance("bfloat16") == ref.tolerance(jnp.zeros(2, jnp.bfloat16))
    assert ref.tolerance(jnp.dtype("float16")) == ref.tolerance(np.float16)


def test_float32_is_judged_as_the_platforms_default_dots_round_it():
    assert [ref.computed_as(np.float32, p) for p in ("cpu", "gpu", "cuda", "tpu")] == [
        "float32",
        "tf32",
        "tf32",
        "bfloat16",
    ]
    assert ref.computed_as("bfloat16", "gpu") == "bfloat16"
    assert ref.tolerance(np.float32, platform="gpu") == ref.tolerance("tf32")
    assert ref.grad_tolerance(np.float32, platform="tpu") == ref.grad_tolerance(jnp.bfloat16)
    assert ref.computed_as(np.float32) == ref.computed_as(np.float32, jax.default_backend())


def test_tf32_tolerances_hold_tf32_dots_and_float32_ones_do_not(x64):
    """Attention with every dot's inputs rounded to TF32's 10 mantissa bits (lax.reduce_precision,
    forward and backward dots alike, as a GPU's default float32 dots) against exact float64: within
    the tf32 tolerances, and beyond float32's (so the key matters)."""
    rng = np.random.default_rng(0)
    b, t, s, n, h = 2, 37, 21, 2, 8
    q, k, v, cot = (rng.normal(size=(b, x, n, h)) for x in (t, s, s, t))
    bias = rng.normal(size=(1, n, t, s))
    tf32 = lambda x: jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=10)

    @jit_reference
    def run(q, k, v, bias, cot):
        results = []
        for r in (lambda x: x, tf32):

            def attend(q, k, v, bias, r=r):
                logits = jnp.einsum("btnh,bsnh->bnts", r(q), r(k)) / math.sqrt(h) + bias
                weights = jax.nn.softmax(logits, axis=-1)
                return jnp.einsum("bnts,bsnh->btnh", r(weights), r(v))

            out, vjp = jax.vjp(attend, q, k, v, bias)
            results.append((out, vjp(cot)))
        return results

    (exact, exact_grads), (rounded, rounded_grads) = run(q, k, v, bias, cot)
    close = lambda a, e, tol: np.testing.assert_allclose(np.asarray(a), np.asarray(e), **tol)
    close(rounded, exact, ref.tolerance("tf32"))
    assert not np.allclose(rounded, exact, **ref.tolerance("float32", platform="cpu"))
    for g, e in zip(rounded_grads, exact_grads, strict=True):
        close(g, e, ref.grad_tolerance("tf32", e))


def test_the_reference_compiles_at_xlas_level_and_its_gradient_is_finite(x64):
    """jit_reference compiles the float64 reference at XLA's default LLVM level whatever this
    process's (conftest.py), and its gradient under a [1, N, T, S] bias broadcast over the batch
    and a key mask is finite and sums as it should. (XLA:CPU at -O0, jaxlib 0.12.0.1, gives inf
    in dq, dk and dbias here.)"""
    rng = np.random.default_rng(0)
    b, t, s, n, h = 3, 37, 21, 2, 8
    q, k, v, cot = (rng.normal(size=(b, x, n, h)) for x in (t, s, s, t))
    bias = rng.normal(size=(1, n, t, s))
    mask = rng.random((b, 1, 1, s)) > 0.3

    @jit_reference
    def run(q, k, v, bias, cot):
        out, vjp = jax.vjp(lambda *a: ref.dot_product_attention(*a, mask, xp=jnp), q, k, v, bias)
        return out, vjp(cot)

    out, (dq, dk, dv, dbias) = run(q, k, v, bias, cot)
    np.testing.assert_allclose(out, ref.dot_product_attention(q, k, v, bias, mask), rtol=1e-12)
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv), ("dbias", dbias)):
        assert np.isfinite(np.asarray(g)).all(), name
    # Softmax's rows sum to 1 whatever the logits: the bias's gradient sums to 0 over the keys.
    np.testing.assert_allclose(np.asarray(dbias).sum(-1), 0.0, atol=1e-10)
    # And each row's weights sum to 1: dv summed over the keys is the cotangent summed over T.
    np.testing.assert_allclose(np.asarray(dv).sum(1), cot.sum(1), rtol=1e-10, atol=1e-10)


def test_tolerance_rejects_unknown_dtypes():
    with pytest.raises(ValueError, match="int32"):
        ref.tolerance(np.int32)
    with pytest.raises(TypeError, match="dtype"):
        ref.grad_tolerance(object())


def test_grad_tolerance_scales_atol_with_the_largest_gradient():
    base = ref.grad_tolerance(np.float32)
    scaled = ref.grad_tolerance(np.float32, np.array([0.5, -40.0]))
    assert scaled == dict(rtol=base["rtol"], atol=40.0 * base["atol"])
    assert ref.grad_tolerance(np.float32, np.array([0.1])) == base


def test_tolerance_dicts_are_copies():
    ref.tolerance(np.float32)["rtol"] = 1.0
    assert ref.tolerance(np.float32)["rtol"] == 1e-5


def test_random_params_shapes_and_output_magnitude(rng):
    params = ref.random_attention_params(rng, A, M, H, C, CV, OUT)
    shapes = {k: v.shape for k, v in params.items()}
    assert shapes == dict(
        query_w=(A, H, C),
        key_w=(M, H, C),
        value_w=(M, H, CV),
        output_w=(H, CV, OUT),
        output_b=(OUT,),
        gating_w=(A, H, CV),
        gating_b=(H, CV),
    )
    assert all(v.dtype == np.float64 and np.all(v != 0) for v in params.values())
    g = ref.random_global_attention_params(rng, A, M, H, C, CV, OUT, gating=False)
    assert {k: v.shape for k, v in g.items()} == dict(
        query_w=(A, H, C), key_w=(M, C), value_w=(M, CV), output_w=(H, CV, OUT), output_b=(OUT,)
    )
    big = ref.random_attention_params(rng, 64, 64, 4, 16, 16, 64)
    out = ref.attention(big, rng.normal(size=(2, 32, 64)), rng.normal(size=(2, 32, 64)))
    assert 0.2 < out.std() < 2.0 and np.abs(out).max() < 10.0


def test_random_family_params_structure(rng):
    row = ref.random_msa_row_attention_params(rng, CM, CZ, NH)
    assert set(row) == {"query_norm", "feat_2d_norm", "feat_2d_weights", "attention"}
    assert row["feat_2d_weights"].shape == (CZ, NH)
    assert row["attention"]["query_w"].shape == (CM, NH, CM // NH)
    assert row["attention"]["output_w"].shape == (NH, CM // NH, CM)
    ln = row["query_norm"]
    assert np.abs(ln["scale"] - 1).max() < 0.5 and np.abs(ln["offset"]).max() < 0.5
    assert np.any(ln["scale"] != 1) and np.any(ln["offset"] != 0)
    glob = ref.random_msa_column_global_attention_params(rng, CM, NH, gating=False)
    assert glob["attention"]["key_w"].shape == (CM, CM // NH)
    assert "gating_w" not in glob["attention"]
    tri = ref.random_triangle_attention_params(rng, CZ, NH)
    assert set(tri) == {"query_norm", "feat_2d_weights", "attention"}
    assert set(ref.random_msa_column_attention_params(rng, CM, NH)) == {"query_norm", "attention"}
