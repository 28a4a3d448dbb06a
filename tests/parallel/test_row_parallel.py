"""Rows over devices (global_config.shard_rows_over, 8 virtual CPU devices): the family modules and
Attention itself compute their own rows on each device under Auto mesh axes (jax.jit with sharded
inputs, the way AF2's own code is sharded), training step, and match one device; the column-wise
modules turn to columns with all-to-alls, and nothing of the MSA's or the pair's size is
gathered. Explicit axes: over two processes (test_two_processes_match_one). The op, AF2's sums over
rows under the swap, and the errors."""

import functools
import importlib.util
import pathlib
import re
import socket
import subprocess
import sys

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gated_attention as ga
from gated_attention.af2 import config
from tests import reference, row_parallel_case
from tests.helpers import all_eqns, assert_close

ROOT = pathlib.Path(__file__).resolve().parents[2]

S, R, C_M, C_Z, H = 16, 16, 16, 8, 2  # 8 devices: 2 MSA rows and 2 pair rows each
# Each code path once (suite time): a row-wise module with the pair bias gathered (MSA row; the
# triangle's starting node differs only in its fused bias, which the ending node has too), the
# column-wise ones turned by all-to-alls with and without a bias (the triangle's ending node, the
# column global attention's positions-first layout; MSA column is the ending node without bias),
# and Attention on its own (the modules' row loop in the shard_map).
MODULES = ("msa_row", "msa_column_global", "triangle_end")
OUTPUTS = (*MODULES, "msa_attention")


def _family(shard_rows_over):
    gc = dict(zero_init=False, shard_rows_over=shard_rows_over)

    def forward(msa, msa_mask, pair, pair_mask):
        config = lambda orientation: dict(num_head=H, orientation=orientation)
        return dict(
            msa_row=ga.MSARowAttentionWithPairBias(config("per_row"), gc)(msa, msa_mask, pair),
            msa_column_global=ga.MSAColumnGlobalAttention(config("per_column"), gc)(msa, msa_mask),
            triangle_end=ga.TriangleAttention(config("per_column"), gc, name="end")(
                pair, pair_mask
            ),
            msa_attention=ga.Attention(dict(num_head=H), gc, C_M)(
                msa, msa, msa_mask.astype(bool)[:, None, None, :]
            ),
        )

    return hk.without_apply_rng(hk.transform(forward))


def _inputs():
    rng = np.random.default_rng(0)
    f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    mask = lambda *shape: jnp.asarray(rng.random(shape) > 0.15, jnp.float32)
    inputs = (f32(S, R, C_M), mask(S, R), f32(R, R, C_Z), mask(R, R))
    cotangents = {m: f32(S, R, C_M) if m.startswith("msa") else f32(R, R, C_Z) for m in OUTPUTS}
    return inputs, cotangents


def _step(fn):
    def step(params, msa, msa_mask, pair, pair_mask, cotangents):
        out, vjp = jax.vjp(
            lambda p, m, z: fn.apply(p, m, msa_mask, z, pair_mask), params, msa, pair
        )
        return out, vjp(cotangents)

    return step


@pytest.fixture(scope="module")
def one_device():
    (msa, msa_mask, pair, pair_mask), cot = _inputs()
    fn = _family(None)
    params = fn.init(jax.random.PRNGKey(0), msa, msa_mask, pair, pair_mask)
    params = jax.tree.map(lambda p: p + 0.1, params)  # gates and LayerNorms that vary
    return (
        params,
        (msa, msa_mask, pair, pair_mask, cot),
        jax.jit(_step(fn))(params, msa, msa_mask, pair, pair_mask, cot),
    )


def test_each_device_computes_its_own_rows(one_device):
    params, args, (want_out, want_grads) = one_device
    mesh = jax.make_mesh((8,), ("rows",), axis_types=(AxisType.Auto,), devices=jax.devices()[:8])
    put = lambda spec: lambda x: jax.device_put(x, NamedSharding(mesh, spec))
    placed = [jax.tree.map(put(P("rows")), a) for a in args]
    params = jax.tree.map(put(P()), params)  # on the mesh, replicated (as the README places them)
    with jax.set_mesh(mesh):  # compiled once, called and read (suite time: a compile each)
        compiled = jax.jit(_step(_family("rows"))).lower(params, *placed).compile()
        out, grads = compiled(params, *placed)
    text = compiled.as_text()
    for name in OUTPUTS:  # the updates come back split as the rows came
        assert out[name].sharding.spec[0] == "rows", (name, out[name].sharding)
    for got, want in zip(
        jax.tree.leaves((out, grads)), jax.tree.leaves((want_out, want_grads)), strict=True
    ):  # atol scaled by max(1, the leaf's largest entry): sums over devices reorder additions
        assert_close(got, want, reference.grad_tolerance("float32", want))
    # What crosses devices: the [h, r, r] pair biases and the parameters' gradients, and the
    # column-wise modules' all-to-alls; nothing of the MSA's or the pair's size is gathered.
    gathered = re.findall(r"= \w+\[([\d,]*)\][^=]*? all-gather(?:-start)?\(", text)
    sizes = [int(np.prod([int(d) for d in g.split(",") if d])) for g in gathered]
    assert all(n <= H * R * R for n in sizes), gathered
    to_all = len(re.findall(r"\ball-to-all(?:-start)?\(", text))
    # Column global and triangle end: their act and mask there, the update back, and in the
    # backward the update's cotangent there and the act's back: 3 + 2 at least each.
    assert 2 * 3 <= to_all <= 2 * 6, to_all


def test_the_rows_axis_must_name_the_context_mesh():
    (msa, msa_mask, pair, pair_mask), _ = _inputs()
    fn = _family("rows")
    params = fn.init(jax.random.PRNGKey(0), msa, msa_mask, pair, pair_mask)
    with pytest.raises(ValueError, match=r"shard_rows_over='rows' names mesh axes, but no mesh"):
        fn.apply(params, msa, msa_mask, pair, pair_mask)
    mesh = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8])
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"names \['rows'\], which the mesh"):
        fn.apply(params, msa, msa_mask, pair, pair_mask)
    unbatched = jnp.ones((4, 2, 8))  # [T, N, H]: no batch dimension to split
    with (
        jax.set_mesh(mesh),
        pytest.raises(ValueError, match=r"query of shape \(4, 2, 8\) has none"),
    ):
        ga.dot_product_attention(unbatched, unbatched, unbatched, shard_rows_over="data")
    for bad in (3, (), ("rows", 2)):
        with pytest.raises(ValueError, match=r"shard_rows_over must be None, a mesh axis name"):
            config.global_config(dict(shard_rows_over=bad))
    assert config.global_config(dict(shard_rows_over=["a", "b"])).shard_rows_over == ("a", "b")


def test_two_processes_match_one(tmp_path):
    """The ending node's training step with the rows over 8 devices in 2 processes (jax.distributed,
    CPU collectives: the all-to-alls cross processes), Explicit axes with the parameters placed on
    the mesh (they enter the shard_map as arguments), matches one device."""
    port = _free_port()
    out = tmp_path / "result.npz"
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.multiprocess_case", str(i), str(port), str(out)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-2000:] for log in logs)
    params, args = row_parallel_case.problem()
    want = jax.jit(row_parallel_case.step())(params, *args)
    got = np.load(out)
    leaves = jax.tree.leaves(want)
    assert len(got.files) == len(leaves)
    for i, w in enumerate(leaves):
        assert_close(got[f"arr_{i}"], w, reference.grad_tolerance("float32", w))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _af2_copy(copy):
    """(config module, swap, modules.py) of an AF2 copy: alphafold-colabfold's or ColabDesign's
    (whose call signatures differ: no is_training, OuterProductMean(act, mask))."""
    from gated_attention.af2 import af2_package

    if copy == "alphafold":
        from alphafold.model import config

        return config, af2_package.use_gated_attention(), af2_package.alphafold_modules
    if importlib.util.find_spec("colabdesign") is None:  # not importorskip: adapt imports it
        pytest.skip("needs colabdesign (the test extra)")
    ga.colabdesign.adapt_colabdesign()
    from colabdesign.af.alphafold.model import config

    return config, ga.colabdesign.use_gated_attention(), ga.colabdesign.colabdesign_modules


@pytest.mark.parametrize("copy", ["alphafold", "colabdesign"])
def test_af2s_sums_over_rows_run_on_columns_under_the_swap(copy):
    """Through use_gated_attention, AF2's incoming triangle multiplication and outer product mean
    with shard_rows_over: turned to columns by all-to-alls (DAP's layouts) rather than summing
    per-device partial products; their training step on 8 devices (Auto axes) matches one device.
    For both AF2 copies: the layouts take each one's call signatures."""
    af2_config, swap, target = _af2_copy(copy)
    c = af2_config.model_config("model_1").model
    evo, gc = c.embeddings_and_evoformer.evoformer, c.global_config
    with gc.unlocked():
        gc.shard_rows_over = "rows"
        gc.deterministic = True

    @swap
    def forward(msa, msa_mask, pair, pair_mask):
        m = target()
        tri = m.TriangleMultiplication(evo.triangle_multiplication_incoming, gc, name="tri_in")
        opm = m.OuterProductMean(evo.outer_product_mean, gc, num_output_channel=C_Z)
        return tri(pair, pair_mask), opm(msa, msa_mask)

    rng = np.random.default_rng(3)
    msa = jnp.asarray(rng.normal(size=(S, R, 256)), jnp.float32)
    pair = jnp.asarray(rng.normal(size=(R, R, C_Z)), jnp.float32)
    msa_mask, pair_mask = jnp.ones((S, R)), jnp.ones((R, R))
    fn = hk.without_apply_rng(hk.transform(forward))
    params = fn.init(jax.random.PRNGKey(0), msa, msa_mask, pair, pair_mask)

    def step(params, msa, pair):
        out, vjp = jax.vjp(
            lambda p, m, z: fn.apply(p, m, msa_mask, z, pair_mask), params, msa, pair
        )
        return out, vjp(jax.tree.map(jnp.ones_like, out))

    one = jax.make_mesh((1,), ("rows",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
    with jax.set_mesh(one):
        want = jax.jit(step)(params, msa, pair)
    mesh = jax.make_mesh((8,), ("rows",), axis_types=(AxisType.Auto,), devices=jax.devices()[:8])
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("rows")))
    with jax.set_mesh(mesh):
        got = jax.jit(step)(params, put(msa), put(pair))
        jaxpr = jax.make_jaxpr(step)(params, put(msa), put(pair))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_close(g, w, reference.grad_tolerance("float32", w))
    # The layouts asked for: each module's inputs on the columns (act and mask), its output on
    # the rows; what XLA makes of them (all-to-alls, gathers) depends on its cost model.
    specs = [
        str(e.params["sharding"].spec)
        for e in all_eqns(jaxpr.jaxpr)
        if e.primitive.name == "sharding_constraint"
    ]
    assert specs.count(str(P(None, "rows"))) >= 2, specs
    assert specs.count(str(P("rows"))) >= 2, specs


def test_the_op_on_each_devices_rows_under_auto_axes():
    """dot_product_attention(shard_rows_over=...) under Auto axes: each device attends for its own
    batch rows (a shared bias and the shared structure replicated, key mask and lengths split);
    output, residual and gradients match one device, and nothing is gathered but the bias."""
    rng = np.random.default_rng(4)
    b, t, n, h = 16, 8, 2, 8
    q, k, v, cot = (jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.float32) for _ in range(4))
    bias = jnp.asarray(rng.normal(size=(1, n, t, t)), jnp.float32)
    mask = jnp.asarray(rng.random((b, 1, 1, t)) > 0.2)
    lengths = jnp.asarray(rng.integers(1, t + 1, size=b), jnp.int32)

    def step(rows, q, k, v, bias, mask, lengths):
        def attend(q, k, v, bias):
            return ga.dot_product_attention(
                q, k, v, bias, mask, is_causal=True, key_value_seq_lengths=lengths,
                return_residual=True, shard_rows_over=rows,
            )  # fmt: skip

        (out, res), vjp = jax.vjp(attend, q, k, v, bias)
        return out, res, vjp((cot, jnp.zeros_like(res)))

    want = jax.jit(functools.partial(step, None))(q, k, v, bias, mask, lengths)
    mesh = jax.make_mesh((8,), ("rows",), axis_types=(AxisType.Auto,), devices=jax.devices()[:8])
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("rows")))
    args = (put(q), put(k), put(v), bias, put(mask), put(lengths))
    with jax.set_mesh(mesh):
        compiled = jax.jit(functools.partial(step, "rows")).lower(*args).compile()
        got = compiled(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_close(g, w, reference.grad_tolerance("float32", w))
    assert got[0].sharding.spec[0] == "rows"
    gathered = re.findall(r"= \w+\[([\d,]*)\][^=]*? all-gather(?:-start)?\(", compiled.as_text())
    assert all(int(np.prod([int(d) for d in g.split(",") if d])) <= n * t * t for g in gathered)
