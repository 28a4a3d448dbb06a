"""Config-driven forward passes: build a module and inputs from an experiment config, time it, report.

The logic behind scripts/run_forward.py, kept here so that the script stays short and the logic is
tested.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import statistics
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gated_attention.af2 import config as config_lib
from gated_attention.af2 import modules
from gated_attention.af2 import params as params_lib
from gated_attention.attention import api as attention
from gated_attention.core import numerics
from gated_attention.parallel import sharding
from gated_attention_tools import measure
from gated_attention_tools.experiment import schema


@dataclasses.dataclass
class Problem:
    """A transformed forward function and its inputs.

    Attributes:
      forward: hk.Transformed; apply(params, rng, *inputs).
      inputs: the positional inputs.
      flops: FLOPs of one forward (projections and attention matmuls).
      names: the inputs' argument names.
    """

    forward: hk.Transformed
    inputs: tuple[Any, ...]
    flops: int
    names: tuple[str, ...] = ()  # the inputs' argument names, for the report


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


def _family_inputs(cfg: ml_collections.ConfigDict):
    """AF2-style inputs: activations [N_seq|N_res, N_res, c], float 0/1 mask, and pair_act (row)."""
    data = cfg.data
    dtype = jnp.dtype(data.dtype)
    rng = np.random.default_rng(cfg.run.seed)
    r, rows = data.num_queries, schema.num_rows(cfg)
    act = jnp.asarray(rng.normal(size=(rows, r, data.q_channels)), dtype)
    keep = rng.random((rows, r)) >= (0.0 if data.mask == "none" else data.masked_fraction)
    inputs = [act, jnp.asarray(keep, dtype)]
    if cfg.module == "msa_row_attention_with_pair_bias":
        inputs.append(jnp.asarray(rng.normal(size=(r, r, data.pair_channels)), dtype))
    return tuple(inputs)


def _family_flops(cfg: ml_collections.ConfigDict, inputs) -> int:
    """Matmul FLOPs of a family module: projections, gate, output, attention and pair bias."""
    module_cfg = config_lib.module_config(cfg.attention)
    rows, r, c = inputs[0].shape
    # Attention runs over batch b of length-n sequences: rows for per_row, columns for per_column.
    b, n = (rows, r) if module_cfg.orientation == "per_row" else (r, rows)
    bias_channels = {
        "msa_row_attention_with_pair_bias": cfg.data.pair_channels,
        "triangle_attention": c,
    }.get(cfg.module, 0)
    return measure.attention_flops(
        batch=b,
        num_queries=n,
        num_keys=n,
        q_channels=c,
        m_channels=c,
        key_dim=module_cfg.key_dim or c,
        value_dim=module_cfg.value_dim or c,
        output_dim=c,
        num_head=module_cfg.num_head,
        gating=module_cfg.gating,
        pair_channels=bias_channels,  # the [h, r, r] pair bias
        global_query="mean" if cfg.module == "msa_column_global_attention" else None,
    )


def _build_family(cfg: ml_collections.ConfigDict) -> Problem:
    module_cls, name = schema.FAMILY[cfg.module], schema.module_name(cfg)

    def fn(*inputs):
        return module_cls(cfg.attention, cfg.global_config, name=name)(*inputs)

    inputs = _family_inputs(cfg)
    act = "pair_act" if cfg.module == "triangle_attention" else "msa_act"
    names = (act, act.replace("act", "mask"), "pair_act")[: len(inputs)]
    return Problem(hk.transform(fn), inputs, _family_flops(cfg, inputs), names)


def build(cfg: ml_collections.ConfigDict) -> Problem:
    """The module named by cfg.module, hk.transform'ed, with random inputs of cfg.data's sizes.

    Family modules are named by `schema.module_name` and run in inference mode (is_training=False),
    so global_config.subbatch_size applies.
    """
    schema.check_experiment(cfg)
    if cfg.module in schema.FAMILY:
        return _build_family(cfg)
    q_data, m_data, mask, nonbatched = _inputs(cfg)
    data, module_cfg = cfg.data, config_lib.module_config(cfg.attention)
    b, q = data.batch, data.num_queries
    flops = functools.partial(
        measure.attention_flops,
        batch=b,
        num_queries=q,
        num_keys=data.num_keys,
        q_channels=data.q_channels,
        m_channels=data.m_channels,
        key_dim=module_cfg.key_dim or data.q_channels,
        value_dim=module_cfg.value_dim or data.m_channels,
        output_dim=data.output_dim,
        num_head=module_cfg.num_head,
        gating=module_cfg.gating,
    )
    if cfg.module == "attention":

        def fn(q_data, m_data, mask, nonbatched):
            module = modules.Attention(cfg.attention, cfg.global_config, data.output_dim)
            return module(q_data, m_data, mask, nonbatched)

        inputs = (q_data, m_data, mask, nonbatched)
        names = ("q_data", "m_data", "mask", "nonbatched_bias")
        count = flops()
    else:

        def fn(q_data, m_data, q_mask):
            module = modules.GlobalAttention(cfg.attention, cfg.global_config, data.output_dim)
            return module(q_data, m_data, q_mask)

        q_mask = None if mask is None else mask[:, 0, 0, :, None]
        q_mask = jnp.ones((b, q, 1), bool) if q_mask is None else q_mask
        inputs = (q_data, m_data, q_mask)
        names = ("q_data", "m_data", "q_mask")
        count = flops(global_query="per_position")
    return Problem(hk.transform(fn), inputs, count, names)


def load_params(
    cfg: ml_collections.ConfigDict,
    path_or_file: params_lib.PathOrFile,
    *,
    prefix: str | None = None,
    layer: int | None = None,
) -> dict[str, dict[str, jax.Array]]:
    """Params for cfg's module from an AF2 .npz checkpoint, checked and cast to the module's dtypes.

    Loads with params.load_af2_params(prefix=..., layer=...), keeps the scopes of the module named
    `schema.module_name(cfg)` (the scope itself and those under it), and checks them against the
    module's own params (jax.eval_shape of its init) with params.check_params.

    Example: AF2 model_1's third Evoformer block, MSA row attention:
      load_params(cfg, 'params_model_1.npz', layer=2,
                  prefix='alphafold/alphafold_iteration/evoformer/evoformer_iteration')

    Raises:
      ValueError: no scope of that name under the prefix, or missing, unexpected or mis-shaped params
        (every one listed); and load_af2_params' errors.
    """
    problem = build(cfg)
    expected = jax.eval_shape(problem.forward.init, jax.random.PRNGKey(0), *problem.inputs)
    loaded = params_lib.load_af2_params(path_or_file, prefix=prefix, layer=layer)
    name = schema.module_name(cfg)
    selected = {k: v for k, v in loaded.items() if k == name or k.startswith(name + "/")}
    if not selected:
        raise ValueError(
            f"no params of module {name!r} (scope {name!r} or {name + '/...'!r}) under prefix "
            f"{prefix!r}; scopes found: {sorted(loaded)[:10]}"
        )
    params_lib.check_params(selected, expected)
    return jax.tree.map(lambda p, e: jnp.asarray(p, e.dtype), selected, expected)


MESH_AXES = ("data", "heads")


# How to install JAX's backend for each platform (JAX's installation guide).
_INSTALL = {
    "gpu": "for NVIDIA GPUs install JAX's CUDA build: pip install -U 'jax[cuda12]'",
    "tpu": "on a TPU VM install JAX's TPU build: pip install -U 'jax[tpu]'",
}


def platform_problem(platform: str) -> str | None:
    """None when JAX can start `platform`, else one line saying it cannot and what to install."""
    try:
        jax.devices(platform)
    except RuntimeError:
        return f"--platform={platform}: JAX finds no {platform} here; {_INSTALL[platform]}"
    return None


def make_mesh(cfg: ml_collections.ConfigDict) -> jax.sharding.Mesh | None:
    """cfg.mesh's data x heads mesh with explicit axes ('data', 'heads'), or None for 1 x 1.

    Raises:
      ValueError: the mesh needs more devices than JAX has.
    """
    shape = (cfg.mesh.data, cfg.mesh.heads)
    size = math.prod(shape)
    if size == 1:
        return None
    devices = jax.devices()
    if size > len(devices):
        hint = (
            f"; on CPU, start with XLA_FLAGS=--xla_force_host_platform_device_count={size}"
            if jax.default_backend() == "cpu"
            else ""
        )
        raise ValueError(
            f"config.mesh asks for data x heads = {shape[0]} x {shape[1]} = {size} devices, but "
            f"JAX has {len(devices)} ({jax.default_backend()}){hint}"
        )
    explicit = (jax.sharding.AxisType.Explicit,) * 2
    return jax.make_mesh(shape, MESH_AXES, axis_types=explicit, devices=devices[:size])


def _input_specs(cfg: ml_collections.ConfigDict, inputs) -> list[P]:
    """Each input's placement: rows over 'data' (the batch, or the pair's rows for triangle
    attention), the nonbatched bias [h, q, k] over 'heads'; the MSA row module's pair_act whole."""
    if cfg.module == "attention":  # q_data, m_data, mask [b|1, ...] or None, nonbatched [h, q, k]
        mask = inputs[2]
        return [
            P("data"),
            P("data"),
            P("data") if mask is not None and mask.shape[0] > 1 else P(),
            P("heads"),
        ]
    if cfg.module == "global_attention":  # q_data, m_data, q_mask
        return [P("data")] * 3
    return [P("data"), P("data")] + [P()] * (len(inputs) - 2)  # act, mask (, pair_act)


def _place(mesh, cfg, params, inputs):
    """params by head over 'heads' (sharding.head_parallel_specs), inputs by _input_specs."""
    put = lambda x, spec: None if x is None else jax.device_put(x, NamedSharding(mesh, spec))
    specs = sharding.head_parallel_specs(params, "heads", mesh)
    params = jax.tree.map(put, params, specs)
    return params, tuple(put(x, s) for x, s in zip(inputs, _input_specs(cfg, inputs), strict=True))


def run_forward(cfg: ml_collections.ConfigDict, params: Any = None) -> dict[str, Any]:
    """Initializes (or takes) params and runs the jit-compiled forward of cfg; returns the report.

    Args:
      cfg: experiment config (schema.experiment_config()).
      params: Haiku params to use instead of a random init (e.g. from an AF2 checkpoint).

    Returns:
      A JSON-serializable dict: devices, shapes, dtype, implementation choices, timings, GFLOP/s,
      memory analysis and an output checksum.
    """
    problem = build(cfg)
    mesh = make_mesh(cfg)
    if params is None:
        params = jax.jit(problem.forward.init)(jax.random.PRNGKey(cfg.run.seed), *problem.inputs)
    inputs = problem.inputs
    if mesh is not None:
        params, inputs = _place(mesh, cfg, params, inputs)

    def apply(params, *inputs):
        return problem.forward.apply(params, None, *inputs)

    with contextlib.ExitStack() as stack:
        if mesh is not None:
            stack.enter_context(jax.set_mesh(mesh))
        choices = stack.enter_context(attention.record_implementation_choices())
        jitted, args = jax.jit(apply), (params, *inputs)
        (compile_s,), _ = measure.time_calls(jitted, args, 1)  # the compiling call, timed apart
        measure.time_calls(jitted, args, cfg.run.warmup)
        step_s, output = measure.time_calls(jitted, args, cfg.run.steps)
        memory = measure.xla_memory(jitted, args)
    out = np.asarray(output, np.float64)
    median_s = statistics.median(step_s)
    return dict(
        module=cfg.module,
        backend=jax.default_backend(),
        devices=[str(d) for d in jax.devices()],
        mesh=None if mesh is None else dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True)),
        output_sharding=None if mesh is None else str(output.sharding.spec),
        dtype=cfg.data.dtype,
        compute_dtype=str(numerics.compute_dtype(cfg.data.dtype, cfg.global_config.compute_dtype)),
        input_shapes={  # by argument name: [4, 64, 64] alone would not say which axis is which
            name: None if x is None else list(x.shape)
            for name, x in zip(problem.names, problem.inputs, strict=True)
        },
        output_shape=list(out.shape),
        implementations=[
            dict(requested=c["requested"], chosen=c["chosen"], reason=c["reason"]) for c in choices
        ],
        compile_s=compile_s,
        median_step_s=median_s,
        min_step_s=min(step_s),
        steps=cfg.run.steps,
        gflops_per_s=problem.flops / median_s / 1e9,
        memory=memory,  # per device on a mesh
        output_checksum=dict(
            sum=float(out.sum()),
            abs_sum=float(np.abs(out).sum()),
            finite=bool(np.isfinite(out).all()),
        ),
    )


def summary(report: dict[str, Any]) -> list[str]:
    """run_forward's report as people read it (scripts/run_forward.py prints it): times in ms and
    memory in MiB to three significant figures (measure.figure); the JSON keeps the raw values."""
    ms = lambda seconds: f"{measure.figure(seconds * 1e3)} ms"
    mib = lambda b: "n/a" if b is None else f"{measure.figure(b / 2**20)} MiB"
    shapes = ", ".join(f"{k} {v}" for k, v in report["input_shapes"].items() if v is not None)
    chosen = "; ".join(
        f"{c['requested']} -> {c['chosen']} ({c['reason']})" for c in report["implementations"]
    )
    memory = report["memory"] or {}
    checksum = report["output_checksum"]
    params = report.get("params") or {}
    n = len(report["devices"])
    sharded = f", sharded {report['output_sharding']}" if report["output_sharding"] else ""
    rows = [
        ("module", report["module"]),
        ("backend", f"{report['backend']} ({n} device{'s' if n > 1 else ''})"),
        ("mesh", report["mesh"] or "none (one device)"),
        ("inputs", f"{shapes}; {report['dtype']}, computed in {report['compute_dtype']}"),
        ("output", f"{report['output_shape']}{sharded}"),
        ("implementation", chosen or "none recorded"),
        ("compile", ms(report["compile_s"])),
        ("median step", f"{ms(report['median_step_s'])} of {report['steps']} steps"),
        ("fastest step", ms(report["min_step_s"])),
        ("speed", f"{measure.figure(report['gflops_per_s'])} GFLOP/s"),
        (
            "XLA memory",
            f"temporaries {mib(memory.get('temp_size_in_bytes'))}, arguments "
            f"{mib(memory.get('argument_size_in_bytes'))}, output {mib(memory.get('output_size_in_bytes'))}",
        ),
        (
            "output check",
            f"{'finite' if checksum['finite'] else 'NOT FINITE'}; sum {checksum['sum']:.6g}, "
            f"sum of |x| {checksum['abs_sum']:.6g}",
        ),
        ("params", params.get("path") or "random init"),
    ]
    return [f"{key:>15}: {value}" for key, value in rows]
