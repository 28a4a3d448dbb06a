"""Test-wide settings: 8 virtual CPU devices (for the multi-device tests; single-device tests run on
the first), float64 available (the reference and float64 inputs need it), hypothesis."""

import os

# Before jax is imported: the host platform's device count is read once, at backend start-up.
_DEVICES_FLAG = "--xla_force_host_platform_device_count"
if _DEVICES_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICES_FLAG}=8".strip()

import jax  # noqa: E402
from hypothesis import settings  # noqa: E402

jax.config.update("jax_enable_x64", True)
# One compilation cache for both pytest-xdist workers: the float64 reference programs and the
# harness's programs of a shape are compiled once, not once per worker (compile time is the cost).
jax.config.update(
    "jax_compilation_cache_dir", os.path.join(os.path.dirname(__file__), ".jax_cache")
)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
settings.load_profile("ci")
