"""The problem of the multi-process row-parallel test (tests/parallel/test_row_parallel.py and its child
processes, tests/multiprocess_case.py): a TriangleAttention (ending node) training step on a small
pair, as NumPy values every process builds alike."""

import haiku as hk
import jax
import numpy as np

import gated_attention as ga

R, C, H = 16, 8, 2


def _module(shard_rows_over):
    config = dict(num_head=H, orientation="per_column")
    gc = dict(zero_init=False, shard_rows_over=shard_rows_over)
    return lambda pair, mask: ga.TriangleAttention(config, gc)(pair, mask, True)


def problem():
    """(parameters, (pair, pair mask, cotangent)) as NumPy float32."""
    rng = np.random.default_rng(0)
    pair = rng.normal(size=(R, R, C)).astype(np.float32)
    mask = (rng.random((R, R)) > 0.1).astype(np.float32)
    cotangent = rng.normal(size=(R, R, C)).astype(np.float32)
    fn = hk.without_apply_rng(hk.transform(_module(None)))
    params = fn.init(jax.random.PRNGKey(0), pair, mask)
    params = jax.tree.map(lambda p: np.asarray(p) + 0.1, params)  # gates and LayerNorms that vary
    return params, (pair, mask, cotangent)


def step(shard_rows_over=None):
    """fn(params, pair, mask, cotangent) -> (update, (parameter gradients, pair gradient))."""
    fn = hk.without_apply_rng(hk.transform(_module(shard_rows_over)))

    def run(params, pair, mask, cotangent):
        update, vjp = jax.vjp(lambda p, x: fn.apply(p, x, mask), params, pair)
        return update, vjp(cotangent)

    return run
