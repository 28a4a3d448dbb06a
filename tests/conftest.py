"""Test-wide settings: 8 virtual CPU devices (for the multi-device tests; single-device tests run on
the first), float64 available (the reference and float64 inputs need it), hypothesis."""

import importlib.metadata
import os


def _add_xla_flag(flag: str, value: str) -> None:
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}={value}".strip()


# Before jax is imported (XLA reads XLA_FLAGS once, at backend start-up; child processes inherit).
_add_xla_flag("--xla_force_host_platform_device_count", "8")
# On a GPU each pytest-xdist worker is a process of its own: none may take 75 % of the memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# jaxlib 0.10 (the Python 3.11 stack): XLA:CPU's legacy fusion emitter, whose compiles take ~20 %
# less of this suite's time (compiling is most of it: 270 s against 305-339 s cold, 2 cores). Results
# are HLO's either way; XLA's current emitter is what the Python 3.12 stack's jaxlib (0.12: no such
# flag, an unknown one is fatal) compiles every test with, and what users and the benchmarks run.
_jaxlib = tuple(int(x) for x in importlib.metadata.version("jaxlib").split(".")[:2])
if _jaxlib < (0, 11):
    _add_xla_flag("--xla_cpu_use_fusion_emitters", "false")

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

jax.config.update("jax_enable_x64", True)
# One compilation cache for both pytest-xdist workers: the float64 reference programs and the
# harness's programs of a shape are compiled once, not once per worker (compile time is the cost).
jax.config.update(
    "jax_compilation_cache_dir", os.path.join(os.path.dirname(__file__), ".jax_cache")
)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
settings.load_profile("ci")


@pytest.fixture
def cudnn_loadable(monkeypatch):
    """cuDNN's library as on a GPU machine, for tests of choices made for a GPU from this host
    (gated_attention.core.compat.cudnn_version; the CUDA plugin alone has none)."""
    from gated_attention.core import compat

    monkeypatch.setattr(compat, "cudnn_version", lambda: 91000)
