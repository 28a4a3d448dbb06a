"""Test-wide settings: float64 available (the reference and float64 inputs need it), hypothesis."""

import jax
from hypothesis import settings

jax.config.update("jax_enable_x64", True)

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
settings.load_profile("ci")
