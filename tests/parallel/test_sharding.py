"""Many devices (8 virtual CPU devices, tests/conftest.py): the op, subbatching and the modules on a
mesh with explicit axes give the float64 reference's values, keep the inputs' sharding, and
communicate only where attention needs it."""

import re

import haiku as hk
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gated_attention as ga
from gated_attention.parallel import row_loop as mapping
from gated_attention.parallel import sharding
from tests import reference
from tests.helpers import all_eqns, assert_close, jit_reference, rand

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")
F32 = reference.tolerance("float32")


@pytest.fixture(scope="module")
def mesh():
    assert len(jax.devices()) >= 8, (
        "the multi-device tests need 8 devices: tests/conftest.py sets "
        "XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax is imported"
    )
    return jax.make_mesh((4, 2), ("data", "model"), devices=jax.devices()[:8])


def put(mesh, x, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def collectives(fn, *args) -> dict[str, int]:
    """How many of each collective the compiled program of jit(fn)(*args) runs."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    return {op: len(re.findall(rf"\b{op}(-start)?\(", text)) for op in COLLECTIVES}


def spec_of(x) -> P:
    spec = tuple(x.sharding.spec)
    while spec and spec[-1] is None:
        spec = spec[:-1]
    return P(*spec)


# q [B, T, N, H]: B=16 rows of T=S=128 positions, 4 heads; large enough that 'xla' runs in row
# tiles and 'chunked' in blocks of one row and several query and key chunks on every device.
B, T, S, N, H = 16, 128, 128, 4, 8
IMPLEMENTATIONS = {
    "xla": ga.XlaAttention(),
    # 48 leaves a rest; blocks of one batch row
    "chunked": ga.ChunkedAttention(query_chunk_size=32, key_chunk_size=48, block_bytes=1),
    # the TPU kernel per shard, in Pallas's interpreter (its TPU interpreter stalls on 8 devices)
    "pallas_tpu": ga.PallasTpuAttention(interpret=True),
}
# (q spec, k/v spec, pair bias [1, N, T, S] spec, mask [B, 1, 1, S] spec) -> (output spec,
# collectives allowed in the forward)
PLACEMENTS = {
    # data and head parallel: no communication at all
    "batch_heads": (P("data", None, "model"), P("data", None, "model"), P(None, "model"), P("data"),
                    P("data", None, "model"), set()),
    # queries split over devices, every key on every device: no communication
    "queries": (P(None, "data"), P(), P(None, None, "data"), P(), P(None, "data"), set()),
    # keys split over devices: attention needs all of them, so they are gathered
    "keys": (P("data"), P("data", "model"), P(), P("data", None, None, "model"), P("data"),
             {"all-gather"}),
}  # fmt: skip


def _op_inputs(seed=0):
    rng = np.random.default_rng(seed)
    q, q64 = rand(rng, (B, T, N, H), jnp.float32)
    k, k64 = rand(rng, (B, S, N, H), jnp.float32)
    v, v64 = rand(rng, (B, S, N, H), jnp.float32)
    pair, pair64 = rand(rng, (1, N, T, S), jnp.float32)
    mask = rng.random((B, 1, 1, S)) > 0.2
    mask[3] = False  # a fully masked row
    return (q, k, v, pair, jnp.asarray(mask)), (q64, k64, v64, pair64, mask)


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_op_on_mesh_matches_reference_and_keeps_sharding(mesh, implementation, placement):
    q_spec, kv_spec, pair_spec, mask_spec, out_spec, allowed = PLACEMENTS[placement]
    (q, k, v, pair, mask), (q64, k64, v64, pair64, mask64) = _op_inputs()
    args = (
        put(mesh, q, q_spec),
        put(mesh, k, kv_spec),
        put(mesh, v, kv_spec),
        put(mesh, pair, pair_spec),
        put(mesh, mask, mask_spec),
    )

    def op(q, k, v, pair, mask):
        return ga.dot_product_attention(
            q, k, v, pair, mask, implementation=IMPLEMENTATIONS[implementation]
        )

    with ga.record_implementation_choices() as choices:
        out = jax.jit(op)(*args)
    assert spec_of(out) == out_spec
    assert_close(out, reference.dot_product_attention(q64, k64, v64, pair64, mask64), F32)
    # Each device chose for its own shard: the shapes recorded are per device.
    local_q = args[0].sharding.shard_shape(q.shape)
    assert choices[0]["query"][:3] == local_q[:3]  # [B, T, N, H] on one device
    used = {name for name, count in collectives(op, *args).items() if count}
    assert used <= allowed, f"unexpected collectives {used - allowed}"


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_op_gradients_on_mesh_match_reference(mesh, implementation):
    """Gradients of data- and head-parallel attention, the bias shared over the batch included
    (its gradient is summed over every device's rows)."""
    (q, k, v, pair, mask), (q64, k64, v64, pair64, mask64) = _op_inputs(seed=1)
    cot, cot64 = rand(np.random.default_rng(2), (B, T, N, H), jnp.float32)
    q_spec, kv_spec, pair_spec, mask_spec, _, _ = PLACEMENTS["batch_heads"]
    specs = (q_spec, kv_spec, kv_spec, pair_spec)
    args = tuple(put(mesh, x, s) for x, s in zip((q, k, v, pair), specs, strict=True))
    mask = put(mesh, mask, mask_spec)
    cot = put(mesh, cot, q_spec)

    def loss(q, k, v, pair):
        out = ga.dot_product_attention(
            q, k, v, pair, mask, implementation=IMPLEMENTATIONS[implementation]
        )
        return jnp.sum(out * cot)

    def ref_loss(q, k, v, pair, mask, cot):
        return jnp.sum(reference.dot_product_attention(q, k, v, pair, mask, xp=jnp) * cot)

    grads = jax.jit(jax.grad(loss, argnums=range(4)))(*args)
    # The float64 reference jitted: one program, not an op-by-op dispatch of its gradient.
    expected = jit_reference(jax.grad(ref_loss, argnums=range(4)))(
        q64, k64, v64, pair64, mask64, cot64
    )
    for name, g, r, x in zip(["q", "k", "v", "pair"], grads, expected, args, strict=True):
        assert spec_of(g) == spec_of(x), name  # gradients come back sharded like their inputs
        assert_close(g, r, reference.grad_tolerance("float32", r), err_msg=f"d{name}")


@pytest.mark.parametrize("axis", [0, -3])
def test_subbatch_loops_over_each_devices_rows(mesh, axis):
    """A batch of 16 sharded over the 4 devices of 'data', in subbatches of 3: each device loops
    over its own 4 rows (3, then a remainder of 1), so nothing is gathered; a shared arg keeps its
    sharding over 'model'."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(16, 8, 5)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(1, 8, 5)), jnp.float32)  # shared by the rows
    calls = []

    def fn(x, w):
        calls.append(x.shape)
        return dict(y=jnp.tanh(x * w).sum(-1, keepdims=True) * x, rows=x[:, :1] * 2)

    args = (put(mesh, x, P("data")), put(mesh, w, P(None, "model")))

    def batched(x, w):
        return mapping.subbatch(fn, [x, w], subbatch_size=3, axis=axis)

    out = jax.jit(batched)(*args)
    assert calls == [(12, 8, 5), (4, 8, 5)]  # 3 rows of each of 4 devices, then 1 row each
    expected = fn(np.asarray(x, np.float64), np.asarray(w, np.float64))
    assert spec_of(out["y"]) == P("data", "model")
    assert spec_of(out["rows"]) == P("data")
    for name in ("y", "rows"):
        assert_close(out[name], expected[name], F32, err_msg=name)
    assert not any(collectives(batched, *args).values())


@pytest.mark.parametrize("remat", [True, False, jax.checkpoint_policies.dots_saveable])
def test_subbatch_gradients_on_explicit_axes_through_the_loops_vjp(mesh, remat):
    """The same loop's gradient on each device's rows, every remat setting through its own custom
    VJP (mapping.tiled, its only gradient path; before, meshes took autodiff of the loop): the
    float64 gradients, sharded like the inputs, no collective, and no batch-sized constant zeros
    (the buffers are made from the data, on meshes too)."""
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(16, 8, 5)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(1, 8, 5)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(5, 5)), jnp.float32)  # closed over (a parameter)
    fn = lambda x, w: jnp.tanh((x * w) @ v) * x  # noqa: E731
    args = (put(mesh, x, P("data")), put(mesh, w, P(None, "model")))

    def loss(x, w):
        return jnp.sum(jnp.sin(mapping.subbatch(fn, [x, w], subbatch_size=3, remat=remat)))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(*args)
    x64, w64 = (np.asarray(a, np.float64) for a in (x, w))
    ref = lambda x, w: jnp.sum(jnp.sin(jnp.tanh((x * w) @ np.asarray(v, np.float64)) * x))  # noqa: E731
    expected = jax.grad(ref, argnums=(0, 1))(x64, w64)
    for name, g, r, a in zip(["x", "w"], grads, expected, args, strict=True):
        assert spec_of(g) == spec_of(a), name
        assert_close(g, r, reference.grad_tolerance("float32", r), err_msg=f"d{name}")
    assert "run_bwd" in str(jax.make_jaxpr(loss)(*args))  # the loop's custom VJP
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(*args)
    zeros = [
        e.params["shape"]
        for e in all_eqns(jaxpr.jaxpr)
        if e.primitive.name == "broadcast_in_dim"
        and isinstance(e.invars[0], jax.extend.core.Literal)
        and np.prod(e.params["shape"]) >= 16 * 8 * 5
    ]
    assert not zeros


def _attention_fn(num_head, output_dim):
    def forward(x, mask, bias):
        module = ga.Attention(dict(num_head=num_head), dict(zero_init=False), output_dim)
        return module(x, x, mask, bias)

    return hk.without_apply_rng(hk.transform(forward))


def _placed_attention(mesh, b, r, c, h, seed):
    """An Attention problem on `mesh`: rows over 'data', heads (params, pair bias) over 'model'.

    Returns:
      (fn, head specs, placed params, placed (x, mask, bias), float64 (params, x, mask, bias) of
      the values placed).
    """
    rng = np.random.default_rng(seed)
    x, x64 = rand(rng, (b, r, c), jnp.float32)
    bias, bias64 = rand(rng, (h, r, r), jnp.float32)
    mask = rng.random((b, 1, 1, r)) > 0.1
    p64 = reference.random_attention_params(rng, c, c, h, c // h, c // h, c)
    params = {"attention": {k: jnp.asarray(v, jnp.float32) for k, v in p64.items()}}
    p64 = {k: np.asarray(v, np.float64) for k, v in params["attention"].items()}  # as rounded
    specs = sharding.head_parallel_specs(params, "model", mesh)
    placed = jax.tree.map(lambda p, s: put(mesh, p, s), params, specs)
    args = (
        put(mesh, x, P("data")),
        put(mesh, jnp.asarray(mask), P("data")),
        put(mesh, bias, P("model")),
    )
    return _attention_fn(h, c), specs, placed, args, (p64, x64, mask, bias64)


def test_attention_module_data_and_head_parallel(mesh):
    """Attention at an MSA-row shape (row tiles inside the op) with the batch over 'data' and heads
    over 'model': the reference's values, and one all-reduce (the sum over heads of the output
    projection) as the only communication."""
    b, r, c = 16, 128, 32
    fn, specs, placed, args, (p64, x64, mask, bias64) = _placed_attention(mesh, b, r, c, 4, seed=4)
    assert specs["attention"]["query_w"] == P(None, "model")

    out = jax.jit(fn.apply)(placed, *args)
    assert spec_of(out) == P("data")
    assert_close(out, reference.attention(p64, x64, x64, mask, bias64), F32)

    # Gradients for the head-sharded parameters and the sharded input, against the reference's.
    cot, cot64 = rand(np.random.default_rng(5), (b, r, c), jnp.float32)
    cot = put(mesh, cot, P("data"))

    def loss(params, x):
        return jnp.sum(fn.apply(params, x, *args[1:]) * cot)

    def ref_loss(p, x, mask, bias, cot):
        return jnp.sum(reference.attention(p, x, x, mask, bias, xp=jnp) * cot)

    grads, dx = jax.jit(jax.grad(loss, argnums=(0, 1)))(placed, args[0])
    ref_grads, ref_dx = jit_reference(jax.grad(ref_loss, argnums=(0, 1)))(
        p64, x64, mask, bias64, cot64
    )
    assert spec_of(dx) == P("data")
    assert_close(dx, ref_dx, reference.grad_tolerance("float32", ref_dx), err_msg="dx")
    for name, g in grads["attention"].items():
        assert spec_of(g) == specs["attention"][name], name
        r_g = ref_grads[name]
        assert_close(g, r_g, reference.grad_tolerance("float32", r_g), err_msg=f"d{name}")

    used = collectives(fn.apply, placed, *args)
    assert used["all-reduce"] >= 1 and used["all-gather"] == 0 and used["all-to-all"] == 0


@pytest.mark.parametrize("orientation", ["per_row", "per_column"])
def test_triangle_attention_with_pair_rows_over_devices(mesh, orientation):
    """Pair rows over 'data', heads over 'model' (AF2's axial split of the pair): per_row attends
    within each device's rows; per_column (ending node) needs the other axis and gets it by
    resharding. Both give the reference's values."""
    r, c, h = 32, 16, 4
    rng = np.random.default_rng(5)
    pair, pair64 = rand(rng, (r, r, c), jnp.float32)
    pair_mask = (rng.random((r, r)) > 0.1).astype(np.float32)
    config = dict(num_head=h, orientation=orientation)

    def forward(pair, pair_mask):
        module = ga.TriangleAttention(config, dict(zero_init=False), name="triangle_attention")
        return module(pair, pair_mask, False)

    fn = hk.without_apply_rng(hk.transform(forward))
    params = reference.random_triangle_attention_params(rng, c, h)
    f32 = {
        "triangle_attention": {"feat_2d_weights": jnp.asarray(params["feat_2d_weights"], "f4")},
        **{
            f"triangle_attention/{scope}": {
                k: jnp.asarray(v, "f4") for k, v in params[scope].items()
            }
            for scope in ("query_norm", "attention")
        },
    }
    init = jax.eval_shape(fn.init, jax.random.PRNGKey(0), pair, jnp.asarray(pair_mask))
    assert jax.tree.map(lambda x: x.shape, init) == jax.tree.map(lambda x: x.shape, f32)
    placed = jax.tree.map(
        lambda p, s: put(mesh, p, s), f32, sharding.head_parallel_specs(f32, "model", mesh)
    )
    args = (put(mesh, pair, P("data")), put(mesh, jnp.asarray(pair_mask), P("data")))

    out = jax.jit(fn.apply)(placed, *args)
    assert spec_of(out) == P("data")
    params64 = jax.tree.map(lambda v: np.asarray(np.float32(v), np.float64), params)  # as placed
    expected = reference.triangle_attention(params64, pair64, pair_mask, h, orientation)
    assert_close(out, expected, reference.tolerance("float32", family=True))


def test_triangle_attention_training_step_with_pair_rows_over_devices():
    """A TriangleAttention training step (the update's cotangent passed in) with the pair's rows
    over 8 devices and a memory budget that cuts each device's 3 rows into pair-bias tiles of 2
    and a remainder: the fused pair-bias backward loops over each device's own rows (it sliced
    the sharded pair: a ShardingTypeError), gathers only the [1, h, r, r] bias, and matches one
    device (float32, relative to each leaf's largest entry)."""
    mesh_axes = jax.make_mesh((8,), ("rows",), devices=jax.devices()[:8])
    r, c, h = 24, 16, 4  # a bias tile row: 96 * r * c bytes; 0.075 MiB holds 2
    config = dict(num_head=h, orientation="per_row")
    module = lambda: ga.TriangleAttention(config, dict(zero_init=False, memory_budget_mib=0.075))
    fn = hk.without_apply_rng(hk.transform(lambda pair, mask: module()(pair, mask, True)))
    rng = np.random.default_rng(9)
    pair, cot = (jnp.asarray(rng.normal(size=(r, r, c)), jnp.float32) for _ in range(2))
    mask = jnp.asarray(rng.random((r, r)) > 0.1, jnp.float32)
    params = fn.init(jax.random.PRNGKey(0), pair, mask)

    def step(params, pair, mask, cot):
        out, vjp = jax.vjp(lambda p, x: fn.apply(p, x, mask), params, pair)
        return out, vjp(cot)

    alone = jax.jit(step)(params, pair, mask, cot)
    args = [put(mesh_axes, x, P("rows")) for x in (pair, mask, cot)]
    with jax.set_mesh(mesh_axes):  # as the README shards (the parameters replicated on it)
        compiled = jax.jit(step).lower(params, *args).compile()  # once: called and read
        on_mesh = compiled(params, *args)
    text = compiled.as_text()
    for got, want in zip(jax.tree.leaves(on_mesh), jax.tree.leaves(alone), strict=True):
        want = np.asarray(want)
        assert np.abs(np.asarray(got) - want).max() <= 1e-5 * np.abs(want).max()
    assert not re.search(r"\ball-to-all(-start)?\(", text)
    gathered = re.findall(r"= (\S+) all-gather(?:-start)?\(", text)
    assert all(f"[1,{h},{r},{r}]" in g for g in gathered), gathered


def test_global_attention_on_mesh(mesh):
    b, q, c, h = 16, 24, 16, 4
    rng = np.random.default_rng(6)
    x, x64 = rand(rng, (b, q, c), jnp.float32)
    q_mask = rng.random((b, q, 1)) > 0.2

    def forward(x, q_mask):
        return ga.GlobalAttention(dict(num_head=h), dict(zero_init=False), c)(x, x, q_mask)

    fn = hk.without_apply_rng(hk.transform(forward))
    params = reference.random_global_attention_params(rng, c, c, h, c // h, c // h, c)
    params = {"attention": {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}}
    specs = sharding.head_parallel_specs(params, "model", mesh)
    assert specs["attention"]["key_w"] == P()  # one key head, shared by every query head
    placed = jax.tree.map(lambda p, s: put(mesh, p, s), params, specs)
    args = (put(mesh, x, P("data")), put(mesh, jnp.asarray(q_mask), P("data")))
    out = jax.jit(fn.apply)(placed, *args)
    assert spec_of(out) == P("data")
    p64 = {k: np.asarray(v, np.float64) for k, v in params["attention"].items()}
    assert_close(out, reference.global_attention(p64, x64, x64, q_mask), F32)


def test_head_parallel_specs_af2_layouts():
    """AF2's parameter layouts, stacked (48 blocks) or not; parameters without a head dimension and
    other modules' parameters are replicated."""
    s = jax.ShapeDtypeStruct
    params = {
        "evoformer/msa_row_attention_with_pair_bias": {"feat_2d_weights": s((48, 128, 8), "f4")},
        "evoformer/msa_row_attention_with_pair_bias/query_norm": {
            "scale": s((48, 256), "f4"),
            "offset": s((48, 256), "f4"),
        },
        "evoformer/msa_row_attention_with_pair_bias/attention": {
            "query_w": s((48, 256, 8, 32), "f4"),
            "key_w": s((48, 256, 8, 32), "f4"),
            "value_w": s((48, 256, 8, 32), "f4"),
            "gating_w": s((48, 256, 8, 32), "f4"),
            "gating_b": s((48, 8, 32), "f4"),
            "output_w": s((48, 8, 32, 256), "f4"),
            "output_b": s((48, 256), "f4"),
        },
        "extra_msa/msa_column_global_attention/attention": {
            "query_w": s((4, 64, 8, 8), "f4"),
            "key_w": s((4, 64, 8), "f4"),  # one shared head: nothing to shard
            "value_w": s((4, 64, 8), "f4"),
            "output_w": s((4, 8, 8, 64), "f4"),
        },
        "triangle_attention": {"feat_2d_weights": s((128, 4), "f4")},
        "triangle_attention/attention": {"query_w": s((128, 4, 32), "f4")},
        "pair_transition": {"transition1": s((128, 512), "f4")},
    }
    specs = sharding.head_parallel_specs(params, "model")
    row = "evoformer/msa_row_attention_with_pair_bias"
    assert specs[row]["feat_2d_weights"] == P(None, None, "model")
    assert specs[row + "/query_norm"] == {"scale": P(), "offset": P()}
    attn = specs[row + "/attention"]
    for name in ("query_w", "key_w", "value_w", "gating_w"):
        assert attn[name] == P(None, None, "model"), name
    assert attn["gating_b"] == P(None, "model")
    assert attn["output_w"] == P(None, "model")
    assert attn["output_b"] == P()
    glob = specs["extra_msa/msa_column_global_attention/attention"]
    assert glob == {
        "query_w": P(None, None, "model"),
        "key_w": P(),
        "value_w": P(),
        "output_w": P(None, "model"),
    }
    assert specs["triangle_attention"]["feat_2d_weights"] == P(None, "model")
    assert specs["triangle_attention/attention"]["query_w"] == P(None, "model")
    assert specs["pair_transition"]["transition1"] == P()
    assert sharding.head_parallel_specs(params, ("data", "model"))["triangle_attention"][
        "feat_2d_weights"
    ] == P(None, ("data", "model"))


def test_head_parallel_specs_errors(mesh):
    s = jax.ShapeDtypeStruct
    params = {"attention": {"query_w": s((64, 3, 8), "f4")}}
    with pytest.raises(
        ValueError, match=r"params\['attention'\]\['query_w'\] of shape \(64, 3, 8\) has 3 heads"
    ):
        sharding.head_parallel_specs(params, "model", mesh)
    with pytest.raises(ValueError, match=r"head_axis \['heads'\] is not an axis of the mesh"):
        sharding.head_parallel_specs({"attention": {}}, "heads", mesh)
    with pytest.raises(TypeError, match=r"params must be Haiku params"):
        sharding.head_parallel_specs([s((2,), "f4")], "model")


def test_explicit_axes_reads_types(mesh):
    x = put(mesh, jnp.ones((8, 4, 2)), P("data", "model"))
    seen = {}

    def f(x, y):
        seen["x"], seen["y"] = sharding.explicit_axes(x), sharding.explicit_axes(y)
        return x

    jax.jit(f)(x, jnp.ones((3,)))
    assert seen["x"][0] is not None and seen["x"][1] == (("data",), ("model",), ())
    assert seen["y"] == (None, ((),))


def test_attention_module_under_auto_axes_is_correct(mesh):
    """Mesh axes of type Auto: shardings are invisible while tracing, so XLA's partitioner decides
    (README: it gathers around the row loops). The values must still be the reference's."""
    auto = jax.make_mesh(
        (4, 2),
        ("data", "model"),
        axis_types=(jax.sharding.AxisType.Auto,) * 2,
        devices=jax.devices()[:8],
    )
    fn, _, placed, args, (p64, x64, mask, bias64) = _placed_attention(auto, 8, 64, 16, 4, seed=8)
    out = jax.jit(fn.apply)(placed, *args)
    assert_close(out, reference.attention(p64, x64, x64, mask, bias64), F32)
