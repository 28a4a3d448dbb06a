"""The import-time jax check: one clear ImportError for a jax too old, nothing for the one here."""

import types

import jax
import pytest

from gated_attention.core import compat


def test_installed_jax_passes():
    compat.check_jax(jax)


@pytest.mark.parametrize(
    "version, names, match",
    [
        (
            "0.4.30",
            compat.REQUIRED,
            r"needs jax >= 0\.10 .* the installed jax is 0\.4\.30\. Upgrade",
        ),
        ("0.9.2", ("typeof", "make_mesh"), r"0\.9\.2, which lacks jax\.shard_map, jax\.set_mesh"),
        ("0.10.0rc1", ("typeof",), r"lacks jax\.shard_map"),
    ],
)
def test_old_jax_is_one_clear_error(version, names, match):
    fake = types.SimpleNamespace(__version__=version, **dict.fromkeys(names, object()))
    with pytest.raises(ImportError, match=match):
        compat.check_jax(fake)
    compat.check_jax(
        types.SimpleNamespace(__version__="0.12.0.1", **dict.fromkeys(compat.REQUIRED))
    )


def test_cudnn_version_reads_jax_s_own_record():
    # jax._src.lib.cuda_versions (private): moved or renamed, this import fails here first.
    from jax._src.lib import cuda_versions

    found = compat.cudnn_version()
    if cuda_versions is None:  # no CUDA plugin
        assert found is None
    else:  # the plugin, with cuDNN on a GPU machine or without it on this CPU machine
        assert found is None or found >= 8000


def test_every_private_jax_symbol_is_behind_compat_and_still_there():
    """The private JAX symbols the library touches, each through one function of compat.py: if
    JAX moves one, this fails here first (not deep inside a trace). No other module of the
    library names jax._src."""
    import pathlib
    import re

    import gated_attention

    state = compat.trace_context_state("gated_attention_test_state", None, "a test's state")
    assert state.value is None
    with state(1):
        assert state.value == 1
    assert "cpu" in compat.registered_backends()
    from jax.experimental.pallas import mosaic_gpu as plgpu

    assert compat.mosaic_gpu_interpret_params(plgpu)() is not None
    assert compat.triton_registration() is not None  # both tested stacks still have it
    package = pathlib.Path(gated_attention.__file__).parent
    private = [
        f"{path.relative_to(package)}:{i}"
        for path in sorted(package.rglob("*.py"))
        if path.name != "compat.py"
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\bjax\._src\b", line.split("#")[0])
    ]
    assert not private, private


_RETRACE = """
import jax, numpy as np
import gated_attention as ga

compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, seconds, **kw: compiles.append(event) if event.endswith("backend_compile_duration") else None
)
double = jax.jit(lambda x: 2 * x)
x = np.ones(3, np.float32)
double(x)
q = np.ones((1, 8, 2, 8), np.float32)
kernels = (ga.PallasTpuAttention(interpret=True), ga.PallasAttention(interpret=True), ga.MosaicAttention(interpret=True))
for kernel in kernels:  # each family's first trace, and its Pallas modules' first use
    jax.eval_shape(lambda q: ga.dot_product_attention(q, q, q, implementation=kernel), q)
before = len(compiles)
double(x)
print("compiled again:", len(compiles) - before)
"""


def test_the_kernels_first_trace_leaves_other_jitted_functions_compiled():
    """In a fresh process: a function jitted before any kernel's first trace is not compiled
    again after it (jax 0.12's Pallas TPU module, imported inside a trace, registered a setting
    that changed every jit cache key: AF2's second recycle compiled the whole model again)."""
    import os
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _RETRACE],
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiled again: 0" in done.stdout, done.stdout
