"""gated_attention.af3.use_gated_attention: the swap of AF3's attention entry points, scoped to the
code traced inside it (this thread, jax.jit's cache), AF3's implementation names mapped, and its
errors. Most of these run on a stand-in module with AF3's entry point (any stack); the last ones
on AlphaFold 3's own (skipped where alphafold3-colabfold is absent: Python < 3.12)."""

from __future__ import annotations

import subprocess
import sys
import threading
import types

import jax
import jax.numpy as jnp
import pytest

import gated_attention as ga
from gated_attention.af3 import swap as af3_swap
from tests.af3 import af3_modules

B, T, N, H = 2, 8, 2, 16


def _stand_in(name="af3_stand_in"):
    """A module with AF3's entry point, whose own attention is a marker (zeros)."""
    module = types.ModuleType(name)

    def dot_product_attention(q, k, v, *, mask=None, bias=None, implementation=None, scale=None):
        return jnp.zeros_like(q)

    module.dot_product_attention = dot_product_attention
    sys.modules[name] = module
    return module


@pytest.fixture
def stand_in():
    module = _stand_in()
    yield module
    del sys.modules[module.__name__]


def _qkv():
    x = jnp.ones((B, T, N, H), jnp.float32)
    return x, x, x


def _who(module, implementation="xla"):
    """'ours' or 'af3': whose attention module.dot_product_attention runs in this thread now."""
    with ga.record_implementation_choices() as record:
        jax.eval_shape(
            lambda q, k, v: module.dot_product_attention(q, k, v, implementation=implementation),
            *_qkv(),
        )
    return "ours" if record else "af3"


def test_importing_the_library_imports_no_alphafold3():
    code = (
        "import sys, gated_attention; print('alphafold3' in sys.modules, 'tokamax' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "False"], done.stdout


def test_swap_is_scoped_reentrant_and_restored_on_error(stand_in):
    entry = ((stand_in.__name__, "dot_product_attention"),)
    swap = ga.af3.use_gated_attention(entry_points=entry)
    assert _who(stand_in) == "af3"
    with swap:
        assert _who(stand_in) == "ours"
        with swap:
            assert _who(stand_in) == "ours"
        assert _who(stand_in) == "ours"
    assert _who(stand_in) == "af3"
    with pytest.raises(RuntimeError), swap:
        raise RuntimeError
    assert _who(stand_in) == "af3"
    q, k, v = _qkv()  # AF3's own function, called outside: AF3's result
    assert float(jnp.abs(stand_in.dot_product_attention(q, k, v)).max()) == 0.0
    assert af3_swap.original_function(stand_in.__name__) is not stand_in.dot_product_attention


def test_swap_does_not_reach_another_thread(stand_in):
    entry = ((stand_in.__name__, "dot_product_attention"),)
    entered, seen = threading.Event(), []

    def other():
        entered.wait(timeout=60)
        seen.append(_who(stand_in))

    thread = threading.Thread(target=other)
    thread.start()
    with ga.af3.use_gated_attention(entry_points=entry):
        entered.set()
        thread.join(timeout=60)
        assert _who(stand_in) == "ours"
    assert seen == ["af3"]


def test_a_jitted_function_is_traced_again_on_the_other_side_of_the_swap(stand_in):
    entry = ((stand_in.__name__, "dot_product_attention"),)
    traces = []

    @jax.jit
    def attend(q, k, v):
        traces.append(_who(stand_in))
        return stand_in.dot_product_attention(q, k, v, implementation="xla")

    q, k, v = _qkv()
    outside = attend(q, k, v)
    with ga.af3.use_gated_attention(entry_points=entry):
        inside = attend(q, k, v)
    again = attend(q, k, v)  # from the cache: AF3's trace
    assert traces == ["af3", "ours"]
    assert float(jnp.abs(outside).max()) == 0.0 == float(jnp.abs(again).max())
    assert jnp.allclose(inside, 1.0)  # ours: the average of ones


@pytest.mark.parametrize(
    "af3_name, setting, expected",
    [
        ("triton", "af3", "pallas"),
        ("cudnn", "af3", "cudnn"),
        ("xla", "af3", "xla"),
        (None, "af3", "auto"),
        ("volta", "af3", "auto"),
        ("triton", "auto", "auto"),
        ("cudnn", "chunked", "chunked"),
    ],
)
def test_implementation_names(af3_name, setting, expected):
    assert ga.af3.af3_implementation(af3_name, setting) == expected


def test_the_swap_runs_the_implementation_it_names(stand_in):
    entry = ((stand_in.__name__, "dot_product_attention"),)
    swap = ga.af3.use_gated_attention("chunked", entry_points=entry)
    with swap, ga.record_implementation_choices() as record:
        jax.eval_shape(lambda *a: stand_in.dot_product_attention(*a), *_qkv())
    assert [r["chosen"] for r in record] == ["chunked"], record


def test_errors_name_the_argument_and_the_options(stand_in):
    with pytest.raises(ValueError, match=r"implementation='flash'.*\['auto', 'af3'\].*'xla'"):
        ga.af3.use_gated_attention("flash")
    with pytest.raises(ValueError, match=r"implementation='flash_v2'.*'cudnn'.*'triton'"):
        ga.af3.af3_implementation("flash_v2")
    entry = ((stand_in.__name__, "dot_product_attention"),)
    with ga.af3.use_gated_attention(entry_points=entry), pytest.raises(ValueError, match="flash"):
        jax.eval_shape(
            lambda *a: stand_in.dot_product_attention(*a, implementation="flash"), *_qkv()
        )


def test_a_missing_package_or_entry_point_says_so():
    missing = ga.af3.use_gated_attention(entry_points=(("no_such_af3_module", "f"),))
    not_installed = r"AlphaFold 3's model is not installed.*pip install"
    with pytest.raises(ImportError, match=not_installed), missing:
        pass
    moved = ga.af3.use_gated_attention(entry_points=(("json", "dot_product_attention"),))
    with pytest.raises(AttributeError, match=r"json.dot_product_attention.*tested with"), moved:
        pass
    with ga.af3.use_gated_attention(entry_points=()):  # nothing was left held
        pass


def test_af3s_entry_points_are_where_the_swap_expects_them():
    """AF3's attention function and tokamax's, swapped and restored (AF3 installed)."""
    af3 = af3_modules.load()
    import tokamax

    entries = (af3.attention, tokamax)
    assert [_who(m) for m in entries] == ["af3", "af3"]
    with ga.af3.use_gated_attention():
        assert [_who(m) for m in entries] == ["ours", "ours"]
    assert [_who(m) for m in entries] == ["af3", "af3"]


def test_our_ops_own_call_to_the_entry_point_is_not_answered_again(stand_in):
    """A peer of ours that calls the swapped function itself (tokamax_*: tokamax's own
    dot_product_attention) reaches the original, once, instead of our op again without end."""
    entry = ((stand_in.__name__, "dot_product_attention"),)
    reached = []

    class Peer(ga.XlaAttention):
        def __call__(self, query, key, value, biases, mask, *, options, **kwargs):
            reached.append(af3_swap.active_implementation() is not None)
            return stand_in.dot_product_attention(query, key, value)  # the stand-in's: zeros

    with ga.af3.use_gated_attention(Peer(), entry_points=entry):
        out = stand_in.dot_product_attention(*_qkv())
        assert _who(stand_in) == "ours"  # and answered again on the next call
    assert reached == [True, True] and not jnp.any(out), (reached, out)


def test_tokamax_peers_under_the_swap_run_tokamax():
    """AF3's tokamax call answered by our op with tokamax's XLA attention (runs on a CPU): the
    peer's own call to tokamax is tokamax's, the result the float64 reference's."""
    import numpy as np

    from tests import reference

    af3_modules.load()  # skips where AF3 (and with it tokamax) is absent: the 3.11 stack
    import tokamax

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32) for _ in "qkv")
    with ga.af3.use_gated_attention("tokamax_xla"), ga.record_implementation_choices() as rec:
        out = tokamax.dot_product_attention(q, k, v)
    assert [r["chosen"] for r in rec] == ["tokamax_xla"], rec
    expected = reference.dot_product_attention(q, k, v)
    np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-6)


def test_the_inline_half_is_opt_in():
    """AF3's diffusion transformer (inline attention only) runs ours under inline=True, AF3's
    under the default swap; inline must be a bool."""
    import haiku as hk
    import jax.numpy as jnp

    from tests.af3 import test_parity

    inputs, _ = test_parity._inputs("diffusion", jnp.float32)
    t = hk.transform(test_parity.diffusion)
    params = jax.eval_shape(t.init, jax.random.PRNGKey(0), *inputs)
    counts = []
    for swap in (ga.af3.use_gated_attention(), ga.af3.use_gated_attention(inline=True)):
        with swap, ga.record_implementation_choices() as record:
            jax.eval_shape(t.apply, params, jax.random.PRNGKey(0), *inputs)
        counts.append(len(record))
    assert counts == [0, 1], counts
    with pytest.raises(TypeError, match="inline must be a bool, got 'yes'"):
        ga.af3.use_gated_attention(inline="yes")


def test_missing_tables_say_what_to_run(monkeypatch, tmp_path):
    """AF3 installed without its chemical-component tables: the swap's FileNotFoundError names
    the missing file and AF3's build_data, before AF3's own import fails inside AF3."""
    af3_modules.load()  # AF3 installed (a skip otherwise)
    from alphafold3.common import resources

    monkeypatch.delitem(sys.modules, "alphafold3.constants.chemical_component_sets")
    monkeypatch.setattr(resources, "ROOT", tmp_path)  # a root without the tables
    with pytest.raises(FileNotFoundError, match=r"chemical_component_sets\.pickle.*build_data"):
        ga.af3.use_gated_attention()
    ga.af3.use_gated_attention(entry_points=())  # stand-ins of AF3's modules read no tables
    monkeypatch.undo()
    ga.af3.use_gated_attention()  # imported once with tables: nothing to say
