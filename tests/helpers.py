"""Helpers shared by the tests: random inputs in a dtype, casting, comparing.

Which implementations a test runs is no longer a list of names here: each implementation has its
own test class (tests/implementation_harness.py), with its capabilities as class attributes.
"""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

DTYPES = ("float32", "bfloat16", "float16", "float64")

# XLA's own LLVM level, for the float64 reference's programs: this process compiles at a lower one
# (conftest.py), and at -O0 XLA:CPU (jaxlib 0.12.0.1) computes the reference's gradient wrong
# under a bias broadcast over the batch (inf in dq, dk and dbias; tests/test_reference.py).
REFERENCE_COMPILE = {"xla_backend_optimization_level": 3}


def jit_reference(fn, **kwargs):
    """jax.jit of a program of the float64 reference, compiled at XLA's default level."""
    return jax.jit(fn, compiler_options=REFERENCE_COMPILE, **kwargs)


def rand(rng, shape, dtype, scale=1.0):
    """A jnp array in `dtype` and its exact float64 value (so the reference sees what we saw).

    Rounded in NumPy (ml_dtypes for bfloat16) and then transferred: no XLA program per shape.
    """
    x = np.asarray(scale * rng.normal(size=shape)).astype(jnp.dtype(dtype))
    return to_device(x), x.astype(np.float64)


def to_device(x):
    """A NumPy array (or a pytree of them) as jax arrays, by jax.device_put: jnp.asarray would
    compile a copy program per shape and dtype (jax 0.10), ~20 ms each."""
    return jax.device_put(x)


def cast_tree(tree, dtype):
    """Every array of a pytree cast to `dtype` (jnp)."""
    return jax.tree.map(lambda x: jnp.asarray(x, dtype), tree)


def as_f64(tree):
    """Every array of a pytree as float64 numpy (converted by NumPy: no XLA program per shape)."""
    return jax.tree.map(lambda x: np.asarray(x).astype(np.float64), tree)


def assert_close(actual, expected, tol, err_msg=""):
    np.testing.assert_allclose(
        np.asarray(actual).astype(np.float64),
        np.asarray(expected),
        err_msg=err_msg,
        **tol,
    )


def all_eqns(jaxpr):
    """Every equation of a jaxpr, recursing into sub-jaxprs (loops, checkpoints, custom rules)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from all_eqns(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from all_eqns(sub)


def device_marks(kind: str) -> list:
    """The marks of a test that runs compiled kernels on a `kind` device ('gpu' or 'tpu'):
    `pytest -m device` selects it (scripts/device_check.py); elsewhere it skips saying why."""
    backend = jax.default_backend()
    reason = f"runs the compiled kernels on a {kind.upper()}; the backend here is {backend!r}"
    return [pytest.mark.device, pytest.mark.skipif(backend != kind, reason=reason)]


def on_device(kind: str):
    """Decorates a test function or class with device_marks(kind)."""

    def mark(test):
        for m in device_marks(kind):
            test = m(test)
        return test

    return mark


def device_param(*values, kind: str, id: str):
    """A pytest.param of a parametrized test that runs compiled kernels on a `kind` device."""
    return pytest.param(*values, marks=device_marks(kind), id=id)


def benchmark_configs():
    """configs/benchmark.py as a module (configs/ is not a package): its get_config(preset)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "configs" / "benchmark.py"
    spec = importlib.util.spec_from_file_location("bench_cfg", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def benchmark_config(preset: str, **overrides):
    """configs/benchmark.py's preset, with `overrides` applied."""
    cfg = benchmark_configs().get_config(preset)
    cfg.update(overrides)
    return cfg
