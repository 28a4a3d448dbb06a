"""Config-driven forward passes: build a module and inputs from an experiment config, time it, report.

The logic behind scripts/run_forward.py and scripts/benchmark.py, kept in the library so that the
scripts stay short and the logic is tested.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from gated_attention import attention, modules
from gated_attention import config as config_lib


@dataclasses.dataclass
class Problem:
    """A transformed forward function and its inputs.

    Attributes:
      forward: hk.Transformed; apply(params, rng, *inputs).
      inputs: the positional inputs.
      flops: FLOPs of one forward (projections and attention matmuls).
    """

    forward: hk.Transformed
    inputs: tuple[Any, ...]
    flops: int


def _inputs(cfg: ml_collections.ConfigDict):
    data = cfg.data
    dtype = jnp.dtype(data.dtype)
    rng = np.random.default_rng(cfg.run.seed)
    b, q, k = data.batch, data.num_queries, data.num_keys
    q_data = jnp.asarray(rng.normal(size=(b, q, data.q_channels)), dtype)
    m_data = jnp.asarray(rng.normal(size=(b, k, data.m_channels)), dtype)
    keep = rng.random((b, 1, 1 if data.mask == "key" else q, k)) >= data.masked_fraction
    mask = None if data.mask == "none" else jnp.asarray(keep)
    nonbatched = None
    if data.nonbatched_bias:
        nonbatched = jnp.asarray(rng.normal(size=(cfg.attention.num_head, q, k)), dtype)
    return q_data, m_data, mask, nonbatched


def build(cfg: ml_collections.ConfigDict) -> Problem:
    """The module named by cfg.module, hk.transform'ed, with random inputs of cfg.data's sizes."""
    config_lib.check_experiment(cfg)
    q_data, m_data, mask, nonbatched = _inputs(cfg)
    data, module_cfg = cfg.data, config_lib.module_config(cfg.attention)
    h = module_cfg.num_head
    key_dim = module_cfg.key_dim or data.q_channels
    value_dim = module_cfg.value_dim or data.m_channels
    b, q, k = data.batch, data.num_queries, data.num_keys
    proj = 2 * b * (q * data.q_channels * key_dim + k * data.m_channels * (key_dim + value_dim))
    out = 2 * b * q * value_dim * data.output_dim + (
        2 * b * q * data.q_channels * value_dim if module_cfg.gating else 0
    )
    if cfg.module == "attention":

        def fn(q_data, m_data, mask, nonbatched):
            module = modules.Attention(cfg.attention, cfg.global_config, data.output_dim)
            return module(q_data, m_data, mask, nonbatched)

        inputs = (q_data, m_data, mask, nonbatched)
        core = 2 * b * h * q * k * (key_dim + value_dim) // h
    else:

        def fn(q_data, m_data, q_mask):
            module = modules.GlobalAttention(cfg.attention, cfg.global_config, data.output_dim)
            return module(q_data, m_data, q_mask)

        q_mask = None if mask is None else mask[:, 0, 0, :, None]
        q_mask = jnp.ones((b, q, 1), bool) if q_mask is None else q_mask
        inputs = (q_data, m_data, q_mask)
        core = 2 * b * k * (key_dim + value_dim)
    return Problem(hk.transform(fn), inputs, proj + out + core)


def time_jitted(fn: Callable, args: tuple, steps: int, warmup: int) -> dict[str, Any]:
    """Compiles fn once (timed apart), then times `steps` calls after `warmup` more.

    Returns:
      dict with compile_s, step_s (list), median_s, min_s and the last output.
    """
    jitted = jax.jit(fn)
    start = time.perf_counter()
    out = jax.block_until_ready(jitted(*args))
    compile_s = time.perf_counter() - start
    for _ in range(warmup):
        out = jax.block_until_ready(jitted(*args))
    step_s = []
    for _ in range(steps):
        start = time.perf_counter()
        out = jax.block_until_ready(jitted(*args))
        step_s.append(time.perf_counter() - start)
    return dict(
        compile_s=compile_s,
        step_s=step_s,
        median_s=statistics.median(step_s),
        min_s=min(step_s),
        output=out,
    )


def memory_analysis(fn: Callable, args: tuple) -> dict[str, int | None]:
    """XLA's compiled memory analysis of jit(fn)(*args): temp, argument and output bytes."""
    stats = jax.jit(fn).lower(*args).compile().memory_analysis()
    keys = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes")
    return {key: (None if stats is None else int(getattr(stats, key))) for key in keys}


def run_forward(cfg: ml_collections.ConfigDict, params: Any = None) -> dict[str, Any]:
    """Initializes (or takes) params and runs the jit-compiled forward of cfg; returns the report.

    Args:
      cfg: experiment config (config.experiment_config() schema).
      params: Haiku params to use instead of a random init (e.g. from an AF2 checkpoint).

    Returns:
      A JSON-serializable dict: devices, shapes, dtype, implementation choices, timings, GFLOP/s,
      memory analysis and an output checksum.
    """
    problem = build(cfg)
    if params is None:
        params = jax.jit(problem.forward.init)(jax.random.PRNGKey(cfg.run.seed), *problem.inputs)

    def apply(params, *inputs):
        return problem.forward.apply(params, None, *inputs)

    with attention.record_implementation_choices() as choices:
        timing = time_jitted(apply, (params, *problem.inputs), cfg.run.steps, cfg.run.warmup)
    out = np.asarray(timing.pop("output"), np.float64)
    return dict(
        module=cfg.module,
        backend=jax.default_backend(),
        devices=[str(d) for d in jax.devices()],
        dtype=cfg.data.dtype,
        input_shapes=[None if x is None else list(x.shape) for x in problem.inputs],
        output_shape=list(out.shape),
        implementations=[
            dict(requested=c["requested"], chosen=c["chosen"], reason=c["reason"]) for c in choices
        ],
        compile_s=timing["compile_s"],
        median_step_s=timing["median_s"],
        min_step_s=timing["min_s"],
        steps=cfg.run.steps,
        gflops_per_s=problem.flops / timing["median_s"] / 1e9,
        memory=memory_analysis(apply, (params, *problem.inputs)),
        output_checksum=dict(
            sum=float(out.sum()),
            abs_sum=float(np.abs(out).sum()),
            finite=bool(np.isfinite(out).all()),
        ),
    )
