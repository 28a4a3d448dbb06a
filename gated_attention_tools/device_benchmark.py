"""The device benchmark (configs/benchmark.py:device and :gpu): the attention op and the Attention
module at AlphaFold 2's shapes, against what a JAX user on a GPU or TPU can reach.

A cell is a level x shape x dtype x mode. Mode 'forward', or 'forward_backward': a training step's
attention, the vjp at a cotangent passed in as an argument (as a model's backward receives it).

  level 'op': q, k, v [B, T, N, H], a bias [1, N, T, S] shared over the batch, a key mask
    [B, 1, 1, S] (the last tenth of the keys masked); the gradients of q, k, v and the bias.
    Variants (OP_VARIANTS):
      auto, mosaic, pallas, cudnn, xla, chunked, pallas_tpu
                      gated_attention.dot_product_attention with that implementation ('auto'
                      records what it chose); one that does not take the case says why;
      jax_nn_xla      jax.nn.dot_product_attention(implementation='xla'): XLA's attention, the
                      op level's baseline;
      jax_nn_cudnn    jax.nn.dot_product_attention(implementation='cudnn');
      af2_colabfold   ColabFold's fused kernel as alphafold-colabfold's Attention calls it on a GPU
                      (q, k, v in the head-major layout AF2's projections write);
      af2_colabfold_packed
                      ColabFold's packed kernel as its AF2 modules call it on a GPU (the Mosaic
                      GPU kernel on Hopper where a bias is given, else Triton's), on q, k, v
                      stacked into its [B, T, 3, N, H] projection (the stack timed with it);
      packed          ours on the same stack: gated_attention.packed_dot_product_attention;
      tokamax_mosaic, tokamax_triton, tokamax_cudnn, tokamax_xla_chunked
                      tokamax.dot_product_attention with that implementation (AlphaFold 3's
                      attention library), where installed;
      cuequivariance  NVIDIA cuEquivariance's triangle_attention (cuequivariance_jax, its CUDA
                      kernel where cuequivariance-ops-jax is installed, else its JAX reference):
                      q, k, v [1, B, N, T, H] in the head-major layout AF2's projections write, the
                      bias [1, 1, N, T, S] in float32 as it asks.
  level 'module': q_data [B, T, N*H], AF2's nonbatched bias [N, T, S] and the key mask, the
    projections and gating included; the gradients of the parameters and q_data. Variants
    (MODULE_VARIANTS): 'ours' (gated_attention.Attention, 'auto') and 'af2', the baseline:
    alphafold.model.modules.Attention as installed (its ColabFold kernel where one loads, else its
    XLA einsums), on the parameters AF2's module initialized.

Per cell: the baseline in float32 at 'highest' matmul precision on the same rounded inputs is the
accuracy reference; every variant is traced, compiled (in parallel threads: compiling is most of a
device run's time), called once (its largest relative difference from the reference and whether it
is finite recorded, then its output dropped), and timed in interleaved rounds: the time is the
median over rounds, the ratio to the baseline the median of per-round ratios. XLA's memory analysis
is recorded per variant, and with cfg.device_memory the memory each call adds at its peak, measured
in a fresh process per level and shape (measure.call_peak; the calls in rising order of XLA's
estimate, so that the device's never-reset peak counter reads exact; a persistent compilation
cache, when set, spares the children the compiles).

A variant that cannot run here (no GPU, a dtype it does not take, a package not installed, out of
memory) is a row with the reason, not a failure. With a deadline, run() starts no cell past it and
lists the cells left as not run. The results record the environment: versions, backend, device,
date and command; the goals (cfg.goals) are judged from the rows.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import functools
import os
import platform as python_platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

import gated_attention as ga
from gated_attention_tools import benchmark, child, floor, measure

OURS_OP = ("auto", "mosaic", "pallas", "cudnn", "xla", "chunked", "pallas_tpu", "packed")
TOKAMAX = ("mosaic", "triton", "cudnn", "xla_chunked")  # tokamax's implementations, as named there
PEERS_OP = (
    "jax_nn_xla", "jax_nn_cudnn", "af2_colabfold", "af2_colabfold_packed",
    *(f"tokamax_{t}" for t in TOKAMAX),
    "cuequivariance",
)  # fmt: skip
OP_VARIANTS = (*OURS_OP, *PEERS_OP)
MODULE_VARIANTS = ("ours", "af2")
VARIANTS = {"op": OP_VARIANTS, "module": MODULE_VARIANTS}
BASELINES = {"op": "jax_nn_xla", "module": "af2"}
LEVELS = tuple(VARIANTS)
MODES = ("forward", "forward_backward")


class UnavailableError(Exception):
    """A variant that cannot run here; the message says why."""


@dataclasses.dataclass(frozen=True)
class OpShape:
    """q, k, v [batch, length, num_head, head_dim]; `bias`: a bias shared over the batch ([1, N, T,
    S] for the op, AF2's nonbatched [N, T, S] for the module); `mask`: a key mask, the last tenth
    of the keys masked."""

    name: str
    batch: int
    length: int
    num_head: int
    head_dim: int
    bias: bool = True
    mask: bool = True


@dataclasses.dataclass(frozen=True)
class Cell:
    level: str
    shape: OpShape
    dtype: str
    mode: str

    @property
    def label(self) -> str:
        return f"{self.level} {self.shape.name} {self.dtype} {self.mode}"

    def as_dict(self) -> dict[str, Any]:
        return dict(
            level=self.level, shape=dataclasses.asdict(self.shape), dtype=self.dtype, mode=self.mode
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Cell:
        return cls(d["level"], OpShape(**d["shape"]), d["dtype"], d["mode"])


# ------------------------------------------------------------------------------------------------
# Inputs and variants
# ------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(1, 2))
def _normal(key, shape, dtype) -> jax.Array:
    """N(0, 1) values drawn on the device (a [1, 8, 16384, 16384] bias would take NumPy seconds)."""
    return jax.random.normal(key, shape).astype(dtype)


def _key_mask(shape: OpShape) -> jax.Array | None:
    n = shape.length
    if not shape.mask:
        return None
    return jnp.asarray(np.broadcast_to(np.arange(n) < n - n // 10, (shape.batch, 1, 1, n)))


def op_inputs(shape: OpShape, dtype: str, mode: str, seed: int = 0) -> tuple:
    """(q, k, v, bias, mask[, cotangent]) of an op cell, drawn in float32 and rounded to dtype."""
    b, n, h, heads = shape.batch, shape.length, shape.head_dim, shape.num_head
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    qkv = [_normal(keys[i], (b, n, heads, h), dtype) for i in range(3)]
    bias = _normal(keys[3], (1, heads, n, n), dtype) if shape.bias else None
    args = (*qkv, bias, _key_mask(shape))
    if mode == "forward_backward":
        args += (_normal(keys[4], (b, n, heads, h), dtype),)
    return args


def _half(what: str, dtype) -> None:
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        raise UnavailableError(f"{what} takes bfloat16 or float16 only, not {jnp.dtype(dtype)}")


def _on_gpu(what: str) -> None:
    if jax.default_backend() != "gpu":
        raise UnavailableError(f"{what} runs on GPU only, the backend is {jax.default_backend()!r}")


def attention_fn(variant: str, dtype, *, interpret: bool = False) -> Callable:
    """fn(q, k, v, bias, mask) -> [B, T, N, H] of an op variant, or raises UnavailableError."""
    if variant == "packed":
        return lambda q, k, v, bias, mask: ga.packed_dot_product_attention(
            jnp.stack([q, k, v], axis=2), bias, mask, compute_dtype="input"
        )
    if variant in OURS_OP:
        impl = variant
        if variant == "pallas":
            impl = ga.PallasAttention(interpret=interpret)
        elif variant == "mosaic":
            impl = ga.MosaicAttention(interpret=interpret)
        elif variant == "pallas_tpu":
            impl = ga.PallasTpuAttention(interpret=interpret)
        return lambda q, k, v, bias, mask: ga.dot_product_attention(
            q, k, v, bias, mask, implementation=impl, compute_dtype="input"
        )
    if variant in ("jax_nn_cudnn", "jax_nn_xla"):
        backend = variant.removeprefix("jax_nn_")
        if backend == "cudnn":
            _on_gpu("jax.nn's cuDNN attention")
            _half("jax.nn's cuDNN attention", dtype)
        return lambda q, k, v, bias, mask: jax.nn.dot_product_attention(
            q, k, v, bias, mask, implementation=backend
        )
    if variant == "af2_colabfold":
        return _af2_colabfold(dtype)
    if variant == "af2_colabfold_packed":
        return _af2_colabfold_packed(dtype)
    if variant.startswith("tokamax_"):
        return _tokamax(variant.removeprefix("tokamax_"))
    if variant == "cuequivariance":
        return _cuequivariance()
    raise ValueError(f"variant must be one of {OP_VARIANTS}, got {variant!r}")


def _colabfold(what: str):
    """(colabfold_kernels.fused_ops, the global_config its AF2 dispatches on this device) for a
    ColabFold kernel adapter, or UnavailableError off a GPU or without the package."""
    _on_gpu(what)
    try:
        from colabfold_kernels import device, fused_ops
    except ImportError as e:
        raise UnavailableError(f"colabfold-kernels is not installed ({e})") from None
    return fused_ops, ml_collections.ConfigDict(device.dispatch("auto"))


def _af2_colabfold(dtype) -> Callable:
    """AF2's kernel choice as alphafold.model.modules.Attention makes it on a GPU."""
    fused_ops, global_config = _colabfold("ColabFold's attention kernel")
    del dtype

    def fn(q, k, v, bias, mask):
        kernel = fused_ops.attention(global_config, q.dtype, q.shape[-1], v.shape[-1])
        if kernel is None:
            raise UnavailableError(f"the package runs {q.dtype} attention through XLA (no kernel)")
        heads = lambda x: jnp.swapaxes(x, 1, 2)  # AF2's projections write [b, h, S, c]
        mask_bias = 1e9 * (mask.astype(q.dtype) - 1.0)  # AF2's additive mask [b, 1, 1, S]
        bias = None if bias is None else bias[0]  # AF2's nonbatched bias [N, T, S], or none
        out = kernel(heads(q), heads(k), heads(v), mask_bias, bias, scale=q.shape[-1] ** -0.5)
        return heads(out)

    return fn


def _af2_colabfold_packed(dtype) -> Callable:
    """ColabFold's packed kernel as alphafold-colabfold's modules call it on a GPU (Attention.packed:
    p [X, Y, G, N, H], the nonbatched bias [N, S, S], kmask [X, S] True where kept; no gate)."""
    fused_ops, global_config = _colabfold("ColabFold's packed attention kernel")

    def fn(q, k, v, bias, mask):
        h = q.shape[-1]
        kernel = fused_ops.packed_attention(global_config, jnp.dtype(dtype), h, v.shape[-1])
        if kernel is None:
            raise UnavailableError(f"the package runs {q.dtype} attention through XLA (no kernel)")
        kmask = jnp.ones((q.shape[0], k.shape[1]), bool) if mask is None else mask[:, 0, 0, :]
        bias = None if bias is None else bias[0]
        return kernel(jnp.stack([q, k, v], axis=2), bias, kmask, None, sm_scale=h**-0.5)

    return fn


def _tokamax(implementation: str) -> Callable:
    """tokamax.dot_product_attention(implementation=...) on the op's inputs as they are."""
    if implementation not in ("xla_chunked",):
        _on_gpu(f"tokamax's {implementation!r} attention")
    try:
        import tokamax
    except ImportError as e:
        raise UnavailableError(f"tokamax is not installed ({e})") from None
    return lambda q, k, v, bias, mask: tokamax.dot_product_attention(
        q, k, v, bias, mask, implementation=implementation
    )


def _cuequivariance() -> Callable:
    """cuequivariance_jax.triangle_attention on the op's inputs, in its layout: the op's batch is
    its N (the triangle's rows), its B is 1."""
    try:
        import cuequivariance_jax as cuex
    except (ImportError, OSError) as e:  # OSError: its CUDA kernels' libraries do not load
        raise UnavailableError(f"cuequivariance-jax does not import here ({e})") from None

    def fn(q, k, v, bias, mask):
        heads = lambda x: jnp.swapaxes(x, 1, 2)[None]  # [B, T, N, H] -> [1, B, N, T, H]
        bias5 = None if bias is None else bias[None].astype(jnp.float32)  # [1, 1, N, T, S]
        if bias5 is None:
            raise UnavailableError("cuEquivariance's triangle attention needs a bias")
        mask5 = None if mask is None else mask[None]  # [1, B, 1, 1, S]
        out, _, _ = cuex.triangle_attention(
            heads(q), heads(k), heads(v), bias5, mask5, scale=q.shape[-1] ** -0.5
        )
        return jnp.swapaxes(out[0], 1, 2)

    return fn


def op_step(attend: Callable, mode: str) -> Callable:
    """The forward fn(q, k, v, bias, mask), or the training step fn(q, k, v, bias, mask, cot):
    the vjp of q, k, v and the bias at the cotangent."""
    if mode == "forward":
        return attend

    def step(q, k, v, bias, mask, cot):
        _, vjp = jax.vjp(lambda q, k, v, bias: attend(q, k, v, bias, mask), q, k, v, bias)
        return vjp(cot)

    return step


def _module_shape(shape: OpShape) -> benchmark.Shape:
    return benchmark.Shape(
        shape.name,
        shape.batch,
        shape.length,
        shape.num_head * shape.head_dim,
        shape.num_head,
        nonbatched_bias=shape.bias,
        mask="key" if shape.mask else "none",
    )


def problem(
    cell: Cell, variants, *, interpret: bool = False, seed: int = 0
) -> tuple[tuple, dict[str, Callable | UnavailableError], Callable]:
    """A cell's (args, {variant: step fn or the UnavailableError saying why not}, the baseline's
    step fn, which computes the float32 reference on the args cast to float32)."""
    if cell.level == "op":
        args = op_inputs(cell.shape, cell.dtype, cell.mode, seed)
        fns = {}
        for variant in variants:
            try:
                attend = attention_fn(variant, jnp.dtype(cell.dtype), interpret=interpret)
                fns[variant] = op_step(attend, cell.mode)
            except UnavailableError as e:
                fns[variant] = e
        return args, fns, op_step(attention_fn(BASELINES["op"], jnp.float32), cell.mode)
    shape = _module_shape(cell.shape)
    transformed = benchmark.forward_fns(shape, ["auto"])
    named = dict(ours=transformed["auto"], af2=transformed[benchmark.AF2])
    x, mask, bias = _module_inputs(cell.shape, cell.dtype, seed)
    params = jax.jit(named["af2"].init)(jax.random.PRNGKey(seed), x, mask, bias)
    params = jax.tree.map(lambda p: (p + 0.1).astype(cell.dtype), params)  # a gate that varies
    args = (params, x, mask, bias)
    if cell.mode == "forward_backward":
        args += (_normal(jax.random.PRNGKey(seed + 1), x.shape, cell.dtype),)
    fns = {v: benchmark.timed_fn(named[v], cell.mode) for v in variants}
    return args, fns, benchmark.timed_fn(named["af2"], cell.mode)


def _module_inputs(shape: OpShape, dtype: str, seed: int):
    b, n, heads = shape.batch, shape.length, shape.num_head
    keys = jax.random.split(jax.random.PRNGKey(seed + 2), 2)
    x = _normal(keys[0], (b, n, heads * shape.head_dim), dtype)
    bias = _normal(keys[1], (heads, n, n), dtype) if shape.bias else None
    mask = _key_mask(shape)
    return x, jnp.ones((b, 1, 1, n), bool) if mask is None else mask, bias


def _float32(tree):
    return jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating)
                        else x, tree)  # fmt: skip


@jax.jit
def _difference(out, reference) -> tuple[jax.Array, jax.Array]:
    """(max |out - reference| / max |reference| over the leaves, every leaf finite)."""
    worst, finite = jnp.float32(0), jnp.bool_(True)
    for x, r in zip(jax.tree.leaves(out), jax.tree.leaves(reference), strict=True):
        x = x.astype(jnp.float32)
        err = jnp.max(jnp.abs(x - r)) / jnp.maximum(jnp.max(jnp.abs(r)), 1e-30)
        worst, finite = jnp.maximum(worst, err), finite & jnp.all(jnp.isfinite(x))
    return worst, finite


# ------------------------------------------------------------------------------------------------
# Compiling and timing a cell
# ------------------------------------------------------------------------------------------------


def _lower(variant: str, fn: Callable, args: tuple):
    """jax.jit(fn) traced and lowered for args, with what 'auto' chose (None elsewhere)."""
    with ga.record_implementation_choices() as choices:
        lowered = jax.jit(fn).lower(*args)
    chosen = sorted({c["chosen"] for c in choices}) if variant == "auto" else None
    return lowered, chosen


def _compile_all(lowered: dict[str, Any], workers: int) -> dict[str, Any]:
    """{variant: Compiled or the exception}: XLA compiles in threads (it releases the GIL)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = {v: pool.submit(low.compile) for v, low in lowered.items()}
    out = {}
    for variant, future in futures.items():
        try:
            out[variant] = future.result()
        except Exception as e:  # a kernel that fails to build here: reported, not fatal
            out[variant] = e
    return out


def _reason(e: BaseException) -> str:
    if isinstance(e, (UnavailableError, NotImplementedError)):
        return str(e)[:500]
    return f"failed: {type(e).__name__}: {e}"[:500]


def _memory_analysis(compiled) -> dict[str, float | None]:
    """measure.compiled_memory's temp and peak in MiB (None: the backend gives no analysis)."""
    memory = measure.compiled_memory(compiled)
    mib = lambda key: None if memory is None else memory[key] / 2**20
    return dict(xla_temp_mib=mib("temp"), xla_peak_mib=mib("peak"))


def _tree_mib(tree) -> float:
    return sum(x.nbytes for x in jax.tree.leaves(tree)) / 2**20


def run_cell(cell: Cell, cfg, log=print) -> list[dict[str, Any]]:
    """One row per variant of the cell's level in cfg.variants (unavailable ones with the reason)."""
    variants = [v for v in cfg.variants if v in VARIANTS[cell.level]]
    baseline = BASELINES[cell.level]
    args, fns, reference_fn = problem(cell, variants, interpret=cfg.interpret_pallas)
    head = dict(
        level=cell.level, shape=cell.shape.name, dtype=cell.dtype, mode=cell.mode,
        shape_dims=dataclasses.asdict(cell.shape), inputs_mib=_tree_mib(args),
    )  # fmt: skip
    rows = {v: head | dict(variant=v) for v in variants}
    lowered = {}
    for variant, fn in fns.items():
        if isinstance(fn, Exception):
            rows[variant]["unavailable"] = _reason(fn)
            continue
        try:
            lowered[variant], chosen = _lower(variant, fn, args)
        except Exception as e:
            rows[variant]["unavailable"] = _reason(e)
            continue
        if chosen:
            rows[variant]["chosen"] = chosen
    start = time.perf_counter()
    compiled = _compile_all(lowered, cfg.compile_workers)
    log(f"  {cell.label}: {len(lowered)} compiled in {time.perf_counter() - start:.1f} s")
    try:
        with jax.default_matmul_precision("highest"):
            reference = jax.jit(reference_fn)(*_float32(args))
    except Exception as e:  # e.g. out of memory in float32: the variants are still timed
        reference = None
        log(f"  {cell.label}: no float32 reference ({_reason(e)})")
    ready = {}
    for variant, exe in compiled.items():
        try:
            if isinstance(exe, Exception):
                raise exe
            (first_s,), out = measure.time_calls(exe, args, 1)
            worst, finite = _difference(out, reference) if reference is not None else (None, None)
            del out
            rows[variant] |= dict(
                first_call_s=first_s,
                rel_diff_vs_float32=None if worst is None else float(worst),
                finite=None if finite is None else bool(finite),
                **_memory_analysis(exe),
            )
            ready[variant] = exe
        except Exception as e:  # e.g. out of memory: reported, the cell goes on
            rows[variant]["unavailable"] = _reason(e)
    del reference
    per_round = {v: [] for v in ready}
    for r in range(cfg.rounds):
        for variant, exe in ready.items():
            seconds, _ = measure.time_calls(exe, args, cfg.steps)
            per_round[variant].append(statistics.median(seconds))
        log(f"  {cell.label}: round {r + 1}/{cfg.rounds} done")
    for variant, times in per_round.items():
        row = rows[variant]
        row["time_ms"] = statistics.median(times) * 1e3
        row["rounds_ms"] = [t * 1e3 for t in times]
        if baseline in per_round:
            ratios = [t / b for t, b in zip(times, per_round[baseline], strict=True)]
            row["ratio_to_baseline"] = statistics.median(ratios)
            row["ratio_range"] = [min(ratios), max(ratios)]
    return list(rows.values())


# ------------------------------------------------------------------------------------------------
# Peak memory, in a fresh process per level and shape
# ------------------------------------------------------------------------------------------------


def peaks(calls: list[list], interpret: bool = False) -> list[dict]:
    """dict(peak_mib, added_mib, exact, how) of each [cell, variant] in `calls`, called in that
    order in this process (child.call's target: a fresh one); peak_mib counts the inputs too. One
    cell's inputs are held at a time, made again when a later call needs them."""
    results, current, args, compiled = [], None, None, {}
    for cell_dict, variant in calls:
        if cell_dict != current:
            args = compiled = None  # freed before the next cell's inputs are made
            cell = Cell.from_dict(cell_dict)
            needed = [v for c, v in calls if c == cell_dict]
            args, fns, _ = problem(cell, needed, interpret=interpret)
            compiled = {v: jax.jit(fns[v]).lower(*args).compile() for v in needed}  # no peak yet
            current = cell_dict
        try:
            peak, out = measure.call_peak(functools.partial(compiled[variant], *args))
            del out
        except Exception as e:
            results.append(dict(note=_reason(e)))
            continue
        added = None if peak["added_bytes"] is None else peak["added_bytes"] / 2**20
        results.append(
            dict(
                peak_mib=None if added is None else _tree_mib(args) + added,
                added_mib=added,
                exact=peak["exact"],
                how=peak["how"],
            )
        )
    return results


def _measure_peaks(rows: list[dict], cfg, deadline, env, log) -> None:
    """Adds each timed row's peak memory, in place: one child process (peaks) per level and shape,
    its calls in rising order of XLA's estimate, so that a device's peak counter reads exact."""
    timed = sorted((r for r in rows if "time_ms" in r), key=lambda r: r.get("xla_peak_mib") or 0.0)
    if not timed:
        return
    shapes = {s[0]: OpShape(*s) for s in cfg.op_shapes}
    cell = lambda r: Cell(r["level"], shapes[r["shape"]], r["dtype"], r["mode"])
    calls = [[cell(r).as_dict(), r["variant"]] for r in timed]
    timeout = None if deadline is None else max(1.0, deadline - time.monotonic())
    kwargs = dict(calls=calls, interpret=cfg.interpret_pallas)
    try:
        got = child.call(f"{__name__}:peaks", kwargs, log=log, env=env, timeout_s=timeout)
    except Exception as e:
        for r in timed:
            r["memory_note"] = f"not measured: {type(e).__name__}: {str(e)[-300:]}"
        return
    for r, peak in zip(timed, got, strict=True):
        r["peak_mib"], r["peak_exact"] = peak.get("peak_mib"), peak.get("exact")
        r["memory_note"] = peak.get("how", peak.get("note"))


# ------------------------------------------------------------------------------------------------
# The suite
# ------------------------------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    """What produced the results: versions, backend, device, date and command."""
    import jaxlib

    device = jax.devices()[0]
    return dict(
        python=python_platform.python_version(),
        jax=jax.__version__,
        jaxlib=jaxlib.__version__,
        backend=jax.default_backend(),
        device_kind=device.device_kind,
        device_count=jax.device_count(),
        cpu_count=os.cpu_count(),
        date_utc=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        command=" ".join(sys.argv),
    )


def cells(cfg) -> list[Cell]:
    """The cells of a config, in order: level, shape, mode, dtype (priority first)."""
    shapes = [OpShape(*s) for s in cfg.op_shapes]
    return [
        Cell(level, s, d, m)
        for level in cfg.levels
        for s in shapes
        for m in cfg.modes
        for d in cfg.dtypes
    ]


def check_config(cfg) -> None:
    """ValueError for variants, levels, modes or goals the suite does not know."""
    known = set(OP_VARIANTS) | set(MODULE_VARIANTS)
    for variant in cfg.variants:
        if variant not in known:
            raise ValueError(f"config.variants entries must be in {sorted(known)}, got {variant!r}")
    for name, values, allowed in (("levels", cfg.levels, LEVELS), ("modes", cfg.modes, MODES)):
        for value in values:
            if value not in allowed:
                raise ValueError(f"config.{name} entries must be in {allowed}, got {value!r}")
    shapes = {s[0] for s in cfg.op_shapes}
    for goal in cfg.goals:
        level, shape, dtype, mode, variant, against, ratio = goal
        if level not in cfg.levels or shape not in shapes or dtype not in cfg.dtypes:
            raise ValueError(f"config.goals entry {goal!r} names a cell the config does not run")
        if mode not in cfg.modes or not {variant, against} <= set(cfg.variants) or ratio <= 0:
            raise ValueError(f"config.goals entry {goal!r}: mode, variants or ratio not run/valid")


def run(cfg: ml_collections.ConfigDict, log=print, deadline: float | None = None) -> dict:
    """Every cell of the config timed in one child process (time_cells), then, with
    cfg.device_memory, the peak memory of each call in children (peaks, one per level and shape): a process that
    timed the cells keeps the device memory its allocator took, so none is measured there, and
    this process never starts the device's backend.

    deadline: a time.monotonic() after which nothing starts (default: cfg.time_budget_s from now,
    if set); the timed cells stop cfg.memory_share of it earlier, and those left are listed as not
    run."""
    check_config(cfg)
    now = time.monotonic()
    if deadline is None and cfg.time_budget_s:
        deadline = now + cfg.time_budget_s
    cells_until = deadline
    if deadline is not None and cfg.device_memory:
        cells_until = now + (deadline - now) * (1 - cfg.memory_share)
    env = child_env(cfg)
    seconds = None if cells_until is None else cells_until - now
    timed = child.call(
        f"{__name__}:time_cells", dict(config=cfg.to_dict(), seconds=seconds), log=log, env=env
    )
    rows = timed["rows"]
    if cfg.device_memory:
        groups = {}  # one child per level and shape: a child's start costs seconds on a device
        for r in rows:
            groups.setdefault((r["level"], r["shape"]), []).append(r)
        for (level, shape), group in groups.items():
            if deadline is not None and time.monotonic() > deadline:
                for r in group:
                    r.setdefault("memory_note", "not measured: the time budget was spent")
                continue
            log(f"peak memory: {level} {shape}")
            _measure_peaks(group, cfg, deadline, env, log)
    environment = timed["environment"] | dict(command=" ".join(sys.argv))  # not the child's
    goals = judge_goals(cfg.goals, rows, environment["backend"])
    return dict(environment=environment, cells=rows, goals=goals)


def child_env(cfg) -> dict[str, str]:
    """The children's environment: nearly all the device's memory theirs (this process holds
    none), and a persistent compilation cache shared by them where cfg names one."""
    env = dict(
        XLA_PYTHON_CLIENT_MEM_FRACTION=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", ".92")
    )
    if cfg.compilation_cache_dir:
        env |= dict(
            JAX_COMPILATION_CACHE_DIR=cfg.compilation_cache_dir,
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        )
    return env


def time_cells(config: dict[str, Any], seconds: float | None) -> dict[str, Any]:
    """child.call's target: run_cell for every cell of the config until `seconds` have passed
    (those left are not run): dict(environment, rows)."""
    cfg = ml_collections.ConfigDict(config)
    deadline = None if seconds is None else time.monotonic() + seconds
    todo, rows = cells(cfg), []
    for i, cell in enumerate(todo):
        if deadline is not None and time.monotonic() > deadline:
            rows += _not_run(cell, cfg, "not run: the time budget was spent")
            continue
        print(f"[{i + 1}/{len(todo)}] {cell.label}", flush=True)
        try:
            rows += run_cell(cell, cfg, log=lambda line: print(line, flush=True))
        except Exception as e:  # its inputs or the module's parameters did not fit, say
            rows += _not_run(cell, cfg, _reason(e))
            continue
    return dict(environment=environment(), rows=rows)


def _not_run(cell: Cell, cfg, why: str) -> list[dict]:
    return [
        dict(level=cell.level, shape=cell.shape.name, dtype=cell.dtype, mode=cell.mode,
             shape_dims=dataclasses.asdict(cell.shape), variant=v, unavailable=why)
        for v in cfg.variants if v in VARIANTS[cell.level]
    ]  # fmt: skip


def judge_goals(goals, rows: list[dict], backend: str) -> list[dict]:
    """Each goal (level, shape, dtype, mode, variant, against, max ratio) with the measured ratio
    (median of per-round ratios, the two timed in the same rounds) and met: True, False, or None
    when either was not timed (the reason given) or the backend is not a GPU or TPU."""
    by = {(r["level"], r["shape"], r["dtype"], r["mode"], r["variant"]): r for r in rows}
    judged = []
    for level, shape, dtype, mode, variant, against, limit in goals:
        a, b = (by.get((level, shape, dtype, mode, v), {}) for v in (variant, against))
        goal = dict(
            level=level, shape=shape, dtype=dtype, mode=mode, variant=variant, against=against,
            max_ratio=limit, ratio=None, met=None,
        )  # fmt: skip
        if "rounds_ms" in a and "rounds_ms" in b:
            ratios = [x / y for x, y in zip(a["rounds_ms"], b["rounds_ms"], strict=True)]
            goal["ratio"] = statistics.median(ratios)
            on_device = backend in ("gpu", "tpu")
            goal["met"] = goal["ratio"] <= limit if on_device else None
            if not on_device:
                goal["note"] = f"not judged: the backend is {backend!r}"
        else:
            missing = a if "rounds_ms" not in a else b
            goal["note"] = "not timed: " + missing.get("unavailable", "not in the results")
        judged.append(goal)
    return judged


def markdown(results: dict[str, Any]) -> str:
    env = results["environment"]
    lines = [
        f"Device benchmark on {env['device_kind']} ({env['backend']}), jax {env['jax']}, Python "
        f"{env.get('python', '?')}, {env['date_utc']}: `{env['command']}`",
        "",
    ]
    if results.get("goals"):
        lines += [
            "| goal | ratio | at most | met |",
            "| --- | ---: | ---: | --- |",
        ]
        for g in results["goals"]:
            what = f"{g['level']} {g['shape']} {g['dtype']} {g['mode']}: {g['variant']} / {g['against']}"
            ratio = "" if g["ratio"] is None else f"{g['ratio']:.3f}"
            met = {True: "met", False: "**missed**", None: g.get("note", "")}[g["met"]]
            lines.append(f"| {what} | {ratio} | {g['max_ratio']} | {met} |")
        lines.append("")
    lines += [
        "Time: median over interleaved rounds; ratio: to the level's baseline (op: jax.nn's XLA "
        "attention; module: AF2's Attention as installed), median and range of per-round ratios. "
        "Peak: memory in use at the call's peak, inputs included (~: an upper bound). Difference: "
        "max |x - reference| / max |reference|, the reference the baseline in float32 at "
        "'highest' precision on the same rounded inputs. Floor: the cell's exponentials, matmuls "
        "or HBM traffic at the device's peak rate, whichever takes longest (floor.py); % of "
        "floor: floor / time.",
        "",
        "| level | shape | dtype | mode | variant | time ms | / baseline (range) | peak MiB "
        "| XLA temp MiB | rel. diff | floor ms (bound) | % of floor |",
        "| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    fmt = lambda x, spec: "" if x is None else format(x, spec)
    for r in results["cells"]:
        variant = r["variant"] + (f" ({', '.join(r['chosen'])})" if r.get("chosen") else "")
        head = f"| {r['level']} | {r['shape']} | {r['dtype']} | {r['mode']} | {variant} |"
        low = cell_floor(r, env["device_kind"])
        bound = "" if low is None else f"{low['floor_ms']:.3g} ({low['bound']})"
        if "time_ms" not in r:
            lines.append(f"{head} {r.get('unavailable', '')[:140]} | | | | | {bound} | |")
            continue
        share = "" if low is None else f"{100 * low['floor_ms'] / r['time_ms']:.1f}"
        ratio = ""
        if "ratio_to_baseline" in r:
            low, high = r["ratio_range"]
            ratio = f"{r['ratio_to_baseline']:.3f} ({low:.2f}-{high:.2f})"
        peak = fmt(r.get("peak_mib"), ".0f")
        if peak and r.get("peak_exact") is False:
            peak = "~" + peak
        diff = fmt(r["rel_diff_vs_float32"], ".1e") + (
            " NOT FINITE" if r["finite"] is False else ""
        )
        lines.append(
            f"{head} {measure.figure(r['time_ms'])} | {ratio} | {peak} | {fmt(r['xla_temp_mib'], '.0f')} "
            f"| {diff} | {bound} | {share} |"
        )
    return "\n".join(lines) + "\n"


def cell_floor(row: dict[str, Any], device_kind: str) -> dict[str, Any] | None:
    """The hardware floor of a result row's cell on the device (floor.py), or None where the
    device or the row's shape is not known (rows of runs before shapes were recorded)."""
    if "shape_dims" not in row:
        return None
    return floor.floor(row["shape_dims"], row["dtype"], row["mode"], device_kind, row["level"])
