"""packed_dot_product_attention: query, key and value as slots 0, 1, 2 of one [..., T, P, N, H]
array ([T, B, P, N, H] positions first; a fourth slot the caller's, AF2's gate), as one projection
by AF2's stacked weights makes them. The Pallas kernels read each slot in place (Plan.packed) and
the Triton kernel writes the whole gradient as one array; the other implementations get the slices
(base.run): every one matches the float64 reference, forward and gradients (the caller's slot's
zero), in both layouts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gated_attention as ga
from gated_attention.attention import base
from tests import reference
from tests.helpers import assert_close, jit_reference

T, B, N, H = 40, 3, 2, 16

IMPLEMENTATIONS = [
    pytest.param("xla", id="xla"),
    pytest.param("chunked", id="chunked"),
    pytest.param(ga.PallasAttention(block_q=16, block_k=16, interpret=True), id="pallas"),
    pytest.param(
        ga.PallasAttention(block_q=16, block_k=16, fused_backward=True, interpret=True),
        id="pallas fused",
    ),
]
# The Mosaic kernel reads a packed array in place where it needs no preparation (half precision,
# whole tiles: 64 queries and block_k keys, a head dim wgmma takes).
MOSAIC = ga.MosaicAttention(block_k=64, bias_grad_programs=2, interpret=True)


def _problem(dtype, t=T, batch=B, heads=N, head_dim=H, positions_first=False, slots=3):
    rng = np.random.default_rng(0)
    draw = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
    qkv = draw(batch, t, slots, heads, head_dim)
    bias = draw(1, heads, t, t)  # shared by the batch, as AF2's pair bias
    mask = jnp.asarray(rng.random((batch, 1, 1, t)) > 0.3).at[1].set(False)  # row 1: no key
    cotangent = draw(batch, t, heads, head_dim)
    if positions_first:
        qkv, cotangent = jnp.swapaxes(qkv, 0, 1), jnp.swapaxes(cotangent, 0, 1)
    return qkv, bias, mask, cotangent


def _reference(qkv, bias, mask, positions_first):
    swap = (lambda x: jnp.swapaxes(x, 0, 1)) if positions_first else (lambda x: x)
    q, k, v = (swap(qkv[:, :, slot]) for slot in range(3))
    return swap(reference.dot_product_attention(q, k, v, bias, mask, xp=jnp))


def _check(implementation, dtype, positions_first, **sizes):
    """Values and the gradients of the packed array and the bias against the float64 reference
    (where slots > 3, the caller's slot's gradient is zero as the reference's is)."""
    qkv, bias, mask, cotangent = _problem(dtype, positions_first=positions_first, **sizes)
    attend = lambda qkv, bias: ga.packed_dot_product_attention(
        qkv, bias, mask, implementation=implementation, positions_first=positions_first,
        compute_dtype="input",
    )  # fmt: skip
    step = jax.jit(lambda ct, *a: (attend(*a), jax.vjp(attend, *a)[1](ct)))
    out, grads = step(cotangent, qkv, bias)
    assert out.shape == cotangent.shape and grads[0].shape == qkv.shape
    with jax.enable_x64(True):
        args64 = [np.asarray(x, np.float64) for x in (qkv, bias)]
        ref = lambda *a: _reference(*a, mask, positions_first)
        expected, ref_vjp = jit_reference(lambda *a: jax.vjp(ref, *a))(*args64)
        ref_grads = ref_vjp(np.asarray(cotangent, np.float64))
    name = jnp.dtype(dtype).name
    assert_close(out, expected, reference.tolerance(name))
    for g, r in zip(grads, ref_grads, strict=True):
        assert_close(g, r, reference.grad_tolerance(name, r))


@pytest.mark.parametrize(
    "positions_first, slots", [(False, 3), (True, 4)], ids=["batch_first", "positions_first_4"]
)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_packed_against_the_reference(implementation, positions_first, slots):
    """float32, a bias shared by the batch, a key mask with a batch row of no key: values and
    the gradients of the packed array (all its slots) and the bias; batch first with q, k and v
    alone, positions first with a fourth slot (AF2's gate) left to the caller."""
    _check(implementation, jnp.float32, positions_first, slots=slots)


def test_the_mosaic_kernel_reads_a_packed_array_in_place():
    """bfloat16 in whole tiles, positions first: the Mosaic kernel's plan reads the slots as
    they lie (no preparation), values and gradients against the reference."""
    plans = []
    make = ga.MosaicAttention._make
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ga.MosaicAttention, "_make", lambda *a: plans.append(make(*a)) or plans[-1])
        _check(MOSAIC, jnp.bfloat16, True, t=64, batch=2, heads=1, head_dim=32, slots=4)
    assert plans and all(p.packed for p in plans)


@pytest.mark.parametrize(
    "implementation", [IMPLEMENTATIONS[2].values[0], MOSAIC], ids=["pallas", "mosaic"]
)
def test_the_kernels_read_the_slots_in_place(implementation):
    """The Pallas kernels take the packed array as it lies: no slice of it in the training
    step's program, and the Triton kernel's gradient is one array (no concatenation of three).
    Without a mask: with one, rows left without a key take the mean of the value slot
    (numerics.finish_rows_without_key), a slice XLA fuses into that reduction."""
    qkv, bias, _, cotangent = _problem(jnp.bfloat16, t=64, batch=2, heads=1, head_dim=32)
    assert "packed" in implementation.TAKES

    def step(qkv, bias, cotangent):
        attend = lambda *a: ga.packed_dot_product_attention(
            *a, implementation=implementation, compute_dtype="input"
        )
        return jax.vjp(attend, qkv, bias)[1](cotangent)

    jaxpr = jax.make_jaxpr(step)(qkv, bias, cotangent)
    sized = lambda e: any(getattr(o.aval, "size", 0) >= cotangent.size for o in e.outvars)
    names = {"slice", "gather", "dynamic_slice", "squeeze"}
    if implementation is not MOSAIC:  # its kernels write dq, dk and dv apart, stacked after
        names.add("concatenate")
    moved = [e for e in jaxpr.jaxpr.eqns if e.primitive.name in names and sized(e)]
    assert not moved, moved


def test_an_implementation_without_it_gets_the_slices():
    """base.run: an implementation whose TAKES lacks packed is called with the three slots."""
    seen = []

    class Recording(ga.XlaAttention):
        def __call__(self, query, key, value, *args, options, **kwargs):
            seen.append((query.shape, key.shape, options.packed))
            return super().__call__(query, key, value, *args, options=options, **kwargs)

    qkv, bias, mask, _ = _problem(jnp.float32)
    options = base.Options(packed=True)
    out = base.run(Recording(), qkv, qkv, qkv, (bias,), mask, scale=H**-0.5,
                   compute_dtype="float32", options=options)  # fmt: skip
    assert seen == [((B, T, N, H), (B, T, N, H), False)] and out.shape == (B, T, N, H)
    expected = ga.dot_product_attention(*(qkv[:, :, s] for s in range(3)), bias, mask)
    assert_close(out, expected, dict(rtol=1e-6, atol=1e-6))


@pytest.mark.parametrize(
    "shape, kwargs, error, match",
    [
        ((T, 3, N), {}, ValueError, r"qkv must be \[\.\.\., T, P, N, H\] with P >= 3 slots \(query, key, value, then any of the caller's\), got \(40, 3, 2\)"),
        ((B, T, 2, N, H), {}, ValueError, r"P >= 3 slots .*, got \(3, 40, 2, 2, 16\)"),
        ((2, T, B, 3, N, H), dict(positions_first=True), ValueError, r"qkv must be \[T, B, P, N, H\] \(positions_first\)"),
        ((B, T, 3, N, H), dict(positions_first=1), TypeError, r"positions_first must be a bool, got 1"),
        ((B, T, 3, N, H), dict(compute_dtype="fast"), ValueError, r"compute_dtype must be one of"),
    ],
)  # fmt: skip
def test_packed_errors(shape, kwargs, error, match):
    with pytest.raises(error, match=match):
        ga.packed_dot_product_attention(jnp.zeros(shape), **kwargs)


def test_packed_refuses_an_integer_array():
    with pytest.raises(TypeError, match="qkv"):
        ga.packed_dot_product_attention(jnp.zeros((B, T, 3, N, H), jnp.int32))


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_a_sharded_packed_array_runs_per_device(axis_type):
    """Sharded rows over 'data' and heads over 'heads', as users shard: on explicit mesh axes
    the packed call runs as dot_product_attention's per-device shard_map on the slices; under
    jax.jit with inputs sharded over Auto axes XLA partitions the program. The same values
    either way, and the output keeps the rows' and heads' sharding."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    qkv, bias, mask, _ = _problem(jnp.float32, batch=4)
    expected = ga.packed_dot_product_attention(qkv, bias, mask, implementation="xla")
    kind = getattr(jax.sharding.AxisType, axis_type)
    mesh = jax.make_mesh((2, 2), ("data", "heads"), axis_types=(kind,) * 2)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    with jax.set_mesh(mesh):
        out = jax.jit(lambda *a: ga.packed_dot_product_attention(*a, implementation="xla"))(
            put(qkv, P("data", None, None, "heads")),
            put(bias, P(None, "heads")),
            put(mask, P("data")),
        )
    assert out.sharding.spec[0] == "data" and out.sharding.spec[2] == "heads"
    assert_close(out, expected, dict(rtol=1e-6, atol=1e-6))


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_positions_first_on_a_mesh_runs_the_kernel(packed, axis_type):
    """Positions first, rows over a 'data' axis, both ways users shard. Explicit: a Pallas kernel
    may not index a typed-sharded ref by slot or row, so the call runs batch first (its
    per-device shard_map) and comes back transposed; Auto (jax.jit with sharded inputs): the
    kernel as it is, XLA partitioning around it. The reference's values and the rows' sharding
    either way."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    qkv, bias, mask, _ = _problem(jnp.float32, batch=4, positions_first=True)
    impl = ga.PallasAttention(block_q=16, block_k=16, interpret=True)
    if packed:
        attend = lambda qkv, *a: ga.packed_dot_product_attention(
            qkv, *a, implementation=impl, positions_first=True
        )
    else:
        attend = lambda qkv, *a: ga.dot_product_attention(
            *base.unpacked(qkv), *a, implementation=impl, positions_first=True
        )
    expected = attend(qkv, bias, mask)
    mesh = jax.make_mesh((2,), ("data",), axis_types=(getattr(jax.sharding.AxisType, axis_type),))
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    with jax.set_mesh(mesh):
        out = jax.jit(attend)(put(qkv, P(None, "data")), bias, put(mask, P("data")))
    assert out.sharding.spec[1] == "data"
    assert_close(out, expected, dict(rtol=1e-6, atol=1e-6))
