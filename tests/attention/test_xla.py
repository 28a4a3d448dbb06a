"""XlaAttention: the harness's tests, whole and in tiles of batch rows, and what tiling promises."""

import jax
import jax.numpy as jnp
import numpy as np

import gated_attention as ga
from tests.helpers import all_eqns, assert_close, rand
from tests.implementation_harness import SHAPE, Case, ImplementationTests, reference_run, run

BATCH, T, S, N, H, HV = SHAPE  # 5 rows
ROWS_BYTES = 2 * 4 * N * T * S  # float32 logits of 2 batch rows: tiles of 2 rows


class TestXlaAttention(ImplementationTests):
    IMPL = ga.XlaAttention()


class TestXlaAttentionRowTiles(ImplementationTests):
    """5 batch rows in tiles of 2: two tiles in the loop and a remainder tile.

    The tiles run the function TestXlaAttention tests in every dtype, and the tile code is the same
    for every dtype; float32 here (each dtype costs a compilation of ~8 s: the loop body and the
    remainder), and bfloat16 inputs in tiles in test_row_tiles_compute_bfloat16_in_float32.
    """

    IMPL = ga.XlaAttention(tile_bytes=ROWS_BYTES)
    DTYPES = ("float32",)


def _outside_loops(jaxpr):
    """The equations of a jaxpr outside its loops: its own, and those of the custom VJP rules
    (mapping's tile loop) and calls it makes, recursively."""
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name in ("scan", "while"):
            continue
        for param in eqn.params.values():
            if isinstance(param, jax.extend.core.ClosedJaxpr):
                yield from _outside_loops(param.jaxpr)
            elif isinstance(param, jax.extend.core.Jaxpr):
                yield from _outside_loops(param)


def _row_tile_problem(dtype):
    """5 rows, a pair bias shared over the batch, a per-row key bias, a query-key mask with a fully
    masked query row; (case, float64 case)."""
    b = BATCH
    rng = np.random.default_rng(7)
    q, q64 = rand(rng, (b, T, N, H), dtype)
    k, k64 = rand(rng, (b, S, N, H), dtype)
    v, v64 = rand(rng, (b, S, N, HV), dtype)
    cot, cot64 = rand(rng, (b, T, N, HV), dtype)
    pair, pair64 = rand(rng, (1, N, T, S), dtype)
    keys, keys64 = rand(rng, (b, 1, 1, S), dtype)
    mask = rng.random((b, 1, T, S)) > 0.3
    mask[1, 0, 2] = False  # a fully masked query row
    return (
        Case(q, k, v, [pair, keys], jnp.asarray(mask), cot),
        Case(q64, k64, v64, [pair64, keys64], mask, cot64),
    )


def test_row_tiles_loop_without_whole_batch_transposes():
    """The tiles are a loop, and the layout change happens inside each tile: outside the loop,
    forward and backward, only the remainder tile (1 row of 5) is transposed, never the whole
    query, key, value or output (no head-major copy of the batch)."""
    case, _ = _row_tile_problem("float32")
    impl = ga.XlaAttention(tile_bytes=ROWS_BYTES)

    def loss(q, k, v, biases):
        out = ga.dot_product_attention(q, k, v, biases, case.mask, implementation=impl)
        return jnp.sum(out * case.cot)

    for fn in (loss, jax.grad(loss, argnums=(0, 1, 2, 3))):
        jaxpr = jax.make_jaxpr(fn)(*case[:4]).jaxpr
        top = list(_outside_loops(jaxpr))
        names = [e.primitive.name for e in top]
        assert "scan" in names or "while" in names, names
        outside = [e.invars[0].aval.shape for e in top if e.primitive.name == "transpose"]
        assert all(shape[0] == 1 for shape in outside), outside  # the remainder's single row
        inside = [
            e.invars[0].aval.shape for e in all_eqns(jaxpr) if e.primitive.name == "transpose"
        ]
        assert (2, T, N, H) in inside, inside  # the check above sees the tiles' transposes


def test_row_tiles_compute_bfloat16_in_float32():
    """compute_dtype='float32': bfloat16 inputs are cast inside the tiles, every dot runs in
    float32, and outputs and gradients are the float64 reference rounded once to bfloat16."""
    case, case64 = _row_tile_problem("bfloat16")
    impl = ga.XlaAttention(tile_bytes=ROWS_BYTES)
    attend = lambda q, k, v, biases: ga.dot_product_attention(  # noqa: E731
        q, k, v, biases, case.mask, implementation=impl, compute_dtype="float32"
    )
    jaxpr = jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(attend(*a).astype(jnp.float32))))(*case[:4])
    dots = [e for e in all_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
    assert dots and all(x.aval.dtype == jnp.float32 for e in dots for x in e.invars)

    out, grads = run(impl, [case], compute_dtype="float32")[0]
    ref_out, ref_grads = reference_run([case64])[0]
    assert out.dtype == jnp.bfloat16
    # One bfloat16 rounding (relative 2^-9) of a float32 result.
    rounding = dict(rtol=2**-8, atol=1e-5)
    assert_close(out, ref_out, rounding, err_msg="output")
    labels = ("dq", "dk", "dv", "dpair", "dkeys")
    for label, g, r in zip(labels, jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        assert g.dtype == jnp.bfloat16
        # The shared bias's gradient is summed over the tiles in float32, then rounded once.
        assert_close(g, r, rounding, err_msg=label)
