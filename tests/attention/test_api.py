"""dot_product_attention's choice of implementation: 'auto' and its rules, priority sequences, names,
instances and what is not an implementation. (Each implementation's numerics: tests/attention/test_xla.py,
tests/attention/test_xla_chunked.py, tests/attention/test_cudnn.py, through tests/implementation_harness.py.)"""

import functools
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gated_attention as ga
from tests import reference
from tests.helpers import assert_close, rand

B, T, S, N, H, HV = 2, 5, 7, 3, 4, 6


def _inputs(lead=(B,), hv=HV, seed=0):
    """q, k, v, a key mask and their float64 copies (the mask as NumPy)."""
    rng = np.random.default_rng(seed)
    q, q64 = rand(rng, (*lead, T, N, H), "float32")
    k, k64 = rand(rng, (*lead, S, N, H), "float32")
    v, v64 = rand(rng, (*lead, S, N, hv), "float32")
    mask = rng.random((*lead, 1, 1, S)) > 0.3
    return (q, k, v, jnp.asarray(mask)), (q64, k64, v64, mask)


def _record(implementation, *args):
    """(the output under jax.jit, the recorded choices)."""
    op = functools.partial(ga.dot_product_attention, implementation=implementation)
    with ga.record_implementation_choices() as choices:
        out = jax.jit(lambda q, k, v, mask: op(q, k, v, mask=mask))(*args)
    return out, choices


def test_auto_records_its_choice_with_flattened_shapes():
    args, args64 = _inputs(lead=(2, 3))
    out, choices = _record(None, *args)
    assert len(choices) == 1
    choice = choices[0]
    assert choice["requested"] == "auto" and choice["chosen"] == "xla"
    assert "MiB" in choice["reason"]
    assert choice["query"] == (6, T, N, H) and choice["key"] == (6, S, N, H)
    assert choice["value"] == (6, S, N, HV)
    expected = reference.dot_product_attention(*args64[:3], mask=args64[3])
    assert_close(out, expected, reference.tolerance("float32"))


def _spec(batch, length, heads=4, head_dim=32):
    return jax.ShapeDtypeStruct((batch, length, heads, head_dim), jnp.float32)


def _auto_choice(auto, q, kv=None):
    kv = q if kv is None else kv
    impl, reason = auto.choose(q, kv, kv, (), None, compute_dtype=jnp.float32)
    assert reason
    return impl


def test_auto_picks_xla_for_small_rows_and_chunked_for_long_rows_or_a_small_budget():
    small = _spec(2, 64)  # one row's float32 logits and weights: 2 * 4 * 4 * 64 * 64 bytes
    row_bytes = 2 * 4 * 4 * 64 * 64
    assert _auto_choice(ga.Auto(), small).name == "xla"
    assert _auto_choice(ga.Auto(), _spec(1, 16384, heads=8)).name == "chunked"
    tiny = ga.Auto(memory_budget_bytes=1024)
    chosen = _auto_choice(tiny, small)
    assert (
        chosen.name == "chunked" and chosen.memory_budget_bytes == 1024
    )  # the budget is passed on
    # The limit is min(memory_budget_bytes, dense_row_bytes), inclusive.
    assert _auto_choice(ga.Auto(dense_row_bytes=row_bytes), small).name == "xla"
    assert _auto_choice(ga.Auto(dense_row_bytes=row_bytes - 1), small).name == "chunked"
    assert _auto_choice(ga.Auto(memory_budget_bytes=row_bytes - 1), small).name == "chunked"
    # Its instances are the ones it runs.
    tuned = ga.XlaAttention(tile_bytes=1)
    assert _auto_choice(ga.Auto(xla=tuned), small) is tuned


def test_a_priority_sequence_falls_through_what_cannot_run():
    # float32: cuDNN cannot take it on any backend (CPU: not a GPU; GPU: not half precision).
    args, args64 = _inputs()
    out, choices = _record(("cudnn", ga.XlaAttention(tile_bytes=1)), *args)
    assert [(c["requested"], c["chosen"]) for c in choices] == [("(cudnn, xla)", "xla")]
    reason = choices[0]["reason"]
    assert reason.startswith("cudnn: ") and reason.endswith("; the first to take the inputs")
    expected = reference.dot_product_attention(*args64[:3], mask=args64[3])
    assert_close(out, expected, reference.tolerance("float32"))


def test_a_priority_sequence_raises_when_none_fits():
    (q, k, v, mask), _ = _inputs(hv=H + 1)  # jax.nn (hence the cuDNN adapter) needs Hv == H
    impls = ("cudnn", ga.CudnnAttention(jax_nn_implementation="xla"))
    with pytest.raises(NotImplementedError) as raised:
        jax.eval_shape(
            lambda q, k, v: ga.dot_product_attention(q, k, v, mask=mask, implementation=impls),
            q,
            k,
            v,
        )
    message = str(raised.value)
    assert message.startswith("no implementation of the priority list takes these inputs: ")
    host = message.split("; compiled for ")[0]  # then each other platform's reasons, if any
    assert host.count("cudnn: ") == 2 and f"got {H} and {H + 1}" in host


def test_names_and_instances():
    assert dict(ga.IMPLEMENTATIONS) == {
        "xla": ga.XlaAttention(),
        "chunked": ga.ChunkedAttention(),
        "cudnn": ga.CudnnAttention(),
        "mosaic": ga.MosaicAttention(),
        "pallas": ga.PallasAttention(),
        "pallas_tpu": ga.PallasTpuAttention(),
        # The peers (peers.py): other libraries' kernels, named where not installed too.
        **{f"tokamax_{t}": ga.TokamaxAttention(t)
           for t in ("mosaic", "triton", "cudnn", "xla_chunked", "xla")},
        "colabfold": ga.ColabFoldAttention(),
        "colabfold_packed": ga.ColabFoldAttention(packed=True),
    }  # fmt: skip
    args, _ = _inputs()
    for implementation, name in (("chunked", "chunked"), (ga.ChunkedAttention(), "chunked")):
        with ga.record_implementation_choices() as choices:
            jax.eval_shape(
                lambda q, k, v, m, i=implementation: ga.dot_product_attention(
                    q, k, v, mask=m, implementation=i
                ),
                *args,
            )
        assert [(c["requested"], c["chosen"]) for c in choices] == [(name, name)]
        assert choices[0]["reason"] == "requested explicitly"


@pytest.mark.parametrize(
    "implementation, error, match",
    [
        (
            "flash",
            ValueError,
            r"implementation must be one of \('auto', 'xla', 'chunked', 'cudnn', 'mosaic', 'pallas', "
            r"'pallas_tpu', 'tokamax_mosaic', .*'colabfold_packed'\)",
        ),
        (("xla", "flash"), ValueError, r"implementation\[1\] must be one of \('auto', 'xla'"),
        ((), ValueError, "implementation must not be an empty sequence"),
        (3, TypeError, "implementation must be a name, an implementation instance"),
        ((ga.XlaAttention(), object()), TypeError, r"implementation\[1\] must be a name"),
        (ga.attention.xla.dense, TypeError, "got function"),
    ],
)
def test_what_is_not_an_implementation(implementation, error, match):
    args, _ = _inputs()
    with pytest.raises(error, match=match):
        jax.eval_shape(
            lambda q, k, v, m: ga.dot_product_attention(
                q, k, v, mask=m, implementation=implementation
            ),
            *args,
        )


def test_recorders_nest_and_keep_to_their_thread():
    """An empty recorder nested in an empty one leaves the outer recording (removal by identity,
    not equality); a call traced by another thread reaches only that thread's recorders."""
    args, _ = _inputs()
    trace = lambda: jax.eval_shape(
        lambda q, k, v, m: ga.dot_product_attention(q, k, v, mask=m), *args
    )
    with ga.record_implementation_choices() as outer:
        with ga.record_implementation_choices() as inner:
            pass
        trace()
        other = threading.Thread(target=trace)
        other.start()
        other.join()
    assert inner == [] and len(outer) == 1


def test_auto_records_why_the_kernels_refused():
    """'auto' for a GPU target with inputs the Pallas kernel and cuDNN refuse (head dim 256,
    float32) names their refusals in the reason of what runs instead."""
    q = jax.ShapeDtypeStruct((2, 16, 2, 256), jnp.float32)
    impl, reason = ga.Auto().choose(q, q, q, (), None, compute_dtype=jnp.float32, platform="gpu")
    assert impl.name == "xla", reason
    assert "pallas refused: " in reason and "head dims <= 128" in reason, reason
    assert "cudnn refused: " in reason and reason.endswith("MiB"), reason


def test_the_library_is_silent_unless_asked(tmp_path):
    """A fresh program that asks for no logging prints nothing of the library's (Python's
    convention: a library never configures output), under absl's app.run too (its INFO verbosity,
    which scripts/run_forward.py runs at); the choice is there at DEBUG on the library's logger."""
    import subprocess
    import sys

    program = tmp_path / "program.py"
    program.write_text(
        "import logging, sys\n"
        "import jax, jax.numpy as jnp\n"
        "from absl import app\n"
        "import gated_attention as ga\n"
        "def main(argv):\n"
        "    q = jnp.ones((1, 8, 2, 4))\n"
        "    jax.jit(ga.dot_product_attention)(q, q, q).block_until_ready()\n"
        "    if len(argv) > 1:\n"
        "        logging.basicConfig(stream=sys.stderr)\n"
        "        logging.getLogger('gated_attention').setLevel(logging.DEBUG)\n"
        "        jax.jit(ga.dot_product_attention)(q[:, :4], q, q).block_until_ready()\n"
        "app.run(main)\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    for asked in (False, True):
        run = subprocess.run(
            [sys.executable, str(program), *(["asked"] if asked else [])],
            capture_output=True, text=True, env=env, timeout=300, check=True,
        )  # fmt: skip
        said = "dot_product_attention: auto ->" in run.stdout + run.stderr
        assert said == asked, run.stderr[-2000:]


def _jvp_case():
    rng = np.random.default_rng(11)
    f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    q, k, v, bias = f32(2, 6, 2, 4), f32(2, 7, 2, 4), f32(2, 7, 2, 4), f32(1, 2, 6, 7)
    mask = jnp.asarray(rng.random((2, 1, 6, 7)) > 0.3).at[1, :, 2].set(False)  # a row: no key
    tangents = tuple(f32(*x.shape) for x in (q, k, v, bias))
    return (q, k, v, bias), mask, tangents


def test_forward_mode_derivatives_with_xla_match_the_reference():
    """jax.jvp and jax.jacfwd of ga.dot_product_attention (implementation='xla', the one the
    error names), against jax.jvp of the float64 reference, a query row without keys included."""
    primals, mask, tangents = _jvp_case()
    ours = lambda q, k, v, b: ga.dot_product_attention(q, k, v, b, mask, implementation="xla")
    exact = lambda q, k, v, b: reference.dot_product_attention(q, k, v, b, mask, xp=jnp)
    out, tangent = jax.jvp(ours, primals, tangents)
    f64 = lambda xs: tuple(jnp.asarray(x, jnp.float64) for x in xs)
    want_out, want_tangent = jax.jvp(exact, f64(primals), f64(tangents))
    np.testing.assert_allclose(out, want_out, **reference.tolerance(jnp.float32))
    np.testing.assert_allclose(tangent, want_tangent, **reference.grad_tolerance(jnp.float32))
    jacobian = jax.jacfwd(ours, argnums=3)(*primals)  # d out / d bias: [B, T, N, H, 1, N, T, S]
    want = jax.jacfwd(exact, argnums=3)(*f64(primals))
    np.testing.assert_allclose(jacobian, want, **reference.grad_tolerance(jnp.float32, want))


def test_forward_mode_derivatives_elsewhere_name_the_implementation_that_takes_them():
    primals, mask, tangents = _jvp_case()
    attend = lambda q, k, v, b: ga.dot_product_attention(q, k, v, b, mask, implementation="chunked")
    with pytest.raises(TypeError, match=r"'chunked' takes reverse-mode .* implementation='xla'"):
        jax.jvp(attend, primals, tangents)
    with pytest.raises(TypeError, match=r"implementation='xla'"):
        jax.jacfwd(attend)(*primals)
    with pytest.raises(TypeError, match="forward-mode"):  # traced by jit first: JAX's words
        jax.jacfwd(jax.jit(attend))(*primals)
    jax.grad(lambda *a: attend(*a).sum())(*primals)  # reverse mode: its own
