"""Helpers shared by the tests: random inputs in a dtype, casting, implementations under test."""

import jax
import jax.numpy as jnp
import numpy as np

import gated_attention as ga

DTYPES = ("float32", "bfloat16", "float16", "float64")

# Every implementation that runs on this backend; each must pass the same tests as 'xla'.
IMPLEMENTATIONS = tuple(name for name in ga.implementation_names() if name not in ("auto", "cudnn"))


def rand(rng, shape, dtype, scale=1.0):
    """A jnp array in `dtype` and its exact float64 value (so the reference sees what we saw)."""
    x = jnp.asarray(scale * rng.normal(size=shape), dtype)
    return x, np.asarray(x.astype(jnp.float64))


def cast_tree(tree, dtype):
    """Every array of a pytree cast to `dtype` (jnp)."""
    return jax.tree.map(lambda x: jnp.asarray(x, dtype), tree)


def as_f64(tree):
    """Every array of a pytree as float64 numpy."""
    return jax.tree.map(lambda x: np.asarray(jnp.asarray(x).astype(jnp.float64)), tree)


def assert_close(actual, expected, tol, err_msg=""):
    np.testing.assert_allclose(
        np.asarray(jnp.asarray(actual).astype(jnp.float64)),
        np.asarray(expected),
        err_msg=err_msg,
        **tol,
    )
