"""The GPU benchmark (configs/benchmark.py:gpu): the attention op at AlphaFold 2's shapes against
the other attention kernels a JAX user on a GPU can reach.

Each cell is a shape x dtype x mode: 'forward', or 'forward_backward' (the training step's
attention: the gradients of q, k, v and the bias). Inputs are in dot_product_attention's layout,
q, k, v [B, T, N, H], a bias [1, N, T, S] shared over the batch and a key mask [B, 1, 1, S].
Variants (VARIANTS):

  pallas, xla, cudnn   gated_attention.dot_product_attention with that implementation;
  jax_nn_cudnn, jax_nn_xla
                       jax.nn.dot_product_attention, the bias and mask as jax.nn takes them;
  af2_colabfold        AlphaFold 2's attention kernel as the alphafold-colabfold package runs it
                       on GPU (colabfold-kernels' fused attention, chosen by its selector; q, k, v
                       in the head-major layout AF2's projections produce);
  tokamax              tokamax.dot_product_attention(implementation='triton'), where installed.

A variant that cannot run here (no GPU, a dtype it does not take, a package not installed) is
listed with the reason, not timed. For the others: the median time over interleaved rounds in this
process, the ratio to the `xla` variant per round (median, range), XLA's temp bytes, the peak
device memory of one call in a fresh process (measure.device_memory) and the relative difference
from a float32 reference (the `xla` variant in float32 with 'highest' matmul precision, on the same
rounded inputs). The results record the environment: versions, backend, device kind, date, command.
"""

from __future__ import annotations

import dataclasses
import datetime
import statistics
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

import gated_attention as ga
from gated_attention_tools import measure

VARIANTS = ("pallas", "xla", "cudnn", "jax_nn_cudnn", "jax_nn_xla", "af2_colabfold", "tokamax")
BASELINE = "xla"
MODES = ("forward", "forward_backward")


class UnavailableError(Exception):
    """A variant that cannot run here; the message says why."""


@dataclasses.dataclass(frozen=True)
class OpShape:
    """q, k, v [batch, length, num_head, head_dim]; `bias`: a [1, N, T, S] bias shared over the
    batch; `mask`: a [B, 1, 1, S] key mask (the last 10% of keys masked)."""

    name: str
    batch: int
    length: int
    num_head: int
    head_dim: int
    bias: bool = True
    mask: bool = True


def inputs(shape: OpShape, dtype: str, seed: int = 0) -> dict[str, Any]:
    """The cell's q, k, v, bias, mask and output cotangent (NumPy float32 values rounded to dtype)."""
    rng = np.random.default_rng(seed)
    b, n, h, heads = shape.batch, shape.length, shape.head_dim, shape.num_head
    arr = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32), dtype)
    mask = None
    if shape.mask:
        mask = jnp.asarray(np.broadcast_to(np.arange(n) < n - n // 10, (b, 1, 1, n)))
    return dict(
        q=arr(b, n, heads, h),
        k=arr(b, n, heads, h),
        v=arr(b, n, heads, h),
        bias=arr(1, heads, n, n) if shape.bias else None,
        mask=mask,
        cot=arr(b, n, heads, h),
    )


def _on_gpu(what: str) -> None:
    if jax.default_backend() != "gpu":
        raise UnavailableError(f"{what} runs on GPU only, the backend is {jax.default_backend()!r}")


def _half(what: str, dtype) -> None:
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        raise UnavailableError(f"{what} takes bfloat16 or float16 only, not {jnp.dtype(dtype)}")


def attention_fn(variant: str, dtype, *, interpret: bool = False) -> Callable:
    """fn(q, k, v, bias, mask) -> [B, T, N, H] of a variant, or raises UnavailableError."""
    if variant in ("pallas", "xla", "cudnn"):
        impl = ga.PallasAttention(interpret=interpret) if variant == "pallas" else variant
        probe = ga.IMPLEMENTATIONS[variant] if variant != "pallas" else impl
        spec = jax.ShapeDtypeStruct((1, 16, 1, 16), dtype)
        try:
            probe.check(spec, spec, spec, (), None, compute_dtype=jnp.dtype(dtype))
        except NotImplementedError as e:
            raise UnavailableError(str(e)) from None
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
    if variant == "tokamax":
        _on_gpu("tokamax's Triton attention")
        try:
            import tokamax
        except ImportError as e:
            raise UnavailableError(f"tokamax is not installed ({e})") from None
        return lambda q, k, v, bias, mask: tokamax.dot_product_attention(
            q, k, v, bias, mask, implementation="triton"
        )
    raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


def _af2_colabfold(dtype) -> Callable:
    """AF2's kernel choice as alphafold.model.modules.Attention makes it on a GPU."""
    _on_gpu("ColabFold's attention kernels")
    try:
        from colabfold_kernels import device, fused_ops
    except ImportError as e:
        raise UnavailableError(f"colabfold-kernels is not installed ({e})") from None
    global_config = ml_collections.ConfigDict(device.dispatch("auto"))

    def fn(q, k, v, bias, mask):
        kernel = fused_ops.attention(global_config, q.dtype, q.shape[-1], v.shape[-1])
        if kernel is None:
            raise UnavailableError(f"the package runs {q.dtype} attention through XLA (no kernel)")
        heads = lambda x: jnp.swapaxes(x, 1, 2)  # AF2's projections write [b, h, S, c]
        mask_bias = 1e9 * (mask.astype(q.dtype) - 1.0)  # AF2's additive mask [b, 1, 1, S]
        out = kernel(heads(q), heads(k), heads(v), mask_bias, bias[0], scale=q.shape[-1] ** -0.5)
        return heads(out)

    return fn


def timed_fn(attend: Callable, mode: str) -> Callable:
    """The jitted forward, or the gradients of sum(out * cot) w.r.t. q, k, v and the bias."""
    if mode == "forward":
        return jax.jit(lambda q, k, v, bias, mask, cot: attend(q, k, v, bias, mask))

    def loss(q, k, v, bias, mask, cot):
        return jnp.sum(attend(q, k, v, bias, mask).astype(jnp.float32) * cot)

    argnums = (0, 1, 2, 3)
    return jax.jit(
        lambda q, k, v, bias, mask, cot: jax.grad(loss, argnums)(q, k, v, bias, mask, cot)
    )


def memory_problem(shape: dict, variant: str, dtype: str, mode: str, interpret: bool = False):
    """measure.device_memory's builder: (fn, specs) of one cell's variant."""
    fn = timed_fn(attention_fn(variant, jnp.dtype(dtype), interpret=interpret), mode)
    x = inputs(OpShape(**shape), dtype)
    specs = tuple(
        None if x[k] is None else jax.ShapeDtypeStruct(x[k].shape, x[k].dtype)
        for k in ("q", "k", "v", "bias", "mask", "cot")
    )
    return fn, specs


def _relative_diff(out, reference) -> float:
    leaves = zip(jax.tree.leaves(out), jax.tree.leaves(reference), strict=True)
    worst = 0.0
    for x, r in leaves:
        x, r = np.asarray(x, np.float64), np.asarray(r, np.float64)
        worst = max(worst, float(np.abs(x - r).max() / max(np.abs(r).max(), 1e-30)))
    return worst


def run_cell(shape: OpShape, dtype: str, mode: str, cfg, log=print) -> list[dict[str, Any]]:
    """One row per variant of cfg.variants (unavailable ones with their reason)."""
    x = inputs(shape, dtype)
    args = tuple(x[k] for k in ("q", "k", "v", "bias", "mask", "cot"))
    fns, rows = {}, {}
    for variant in cfg.variants:
        row = dict(shape=shape.name, dtype=dtype, mode=mode, variant=variant)
        try:
            fn = timed_fn(attention_fn(variant, dtype, interpret=cfg.interpret_pallas), mode)
            (row["compile_s"],), out = measure.time_calls(fn, args, 1)
        except UnavailableError as e:
            rows[variant] = row | dict(unavailable=str(e))
            continue
        except Exception as e:  # a kernel that fails to build or run here: reported, not fatal
            rows[variant] = row | dict(unavailable=f"failed: {type(e).__name__}: {e}"[:500])
            continue
        fns[variant], rows[variant] = fn, row | dict(output=out)
    with jax.default_matmul_precision("highest"):
        f32 = tuple(None if a is None or a.dtype == bool else a.astype(jnp.float32) for a in args)
        f32 = f32[:4] + (args[4],) + f32[5:]
        reference = timed_fn(attention_fn(BASELINE, jnp.float32), mode)(*f32)
    per_round = {v: [] for v in fns}
    for r in range(cfg.rounds):
        for variant, fn in fns.items():
            per_round[variant].append(statistics.median(measure.time_calls(fn, args, cfg.steps)[0]))
        log(f"  {shape.name} {dtype} {mode}: round {r + 1}/{cfg.rounds} done")
    for variant, fn in fns.items():
        row = rows[variant]
        row["rel_diff_vs_float32"] = _relative_diff(row.pop("output"), reference)
        row["time_ms"] = statistics.median(per_round[variant]) * 1e3
        row["rounds_ms"] = [t * 1e3 for t in per_round[variant]]
        if BASELINE in per_round:
            ratios = [t / b for t, b in zip(per_round[variant], per_round[BASELINE], strict=True)]
            row["ratio_to_xla"] = statistics.median(ratios)
            row["ratio_range"] = [min(ratios), max(ratios)]
        row["temp_bytes"] = measure.xla_memory(fn, args)["temp_size_in_bytes"]
        if cfg.device_memory:
            kwargs = dict(
                shape=dataclasses.asdict(shape),
                variant=variant,
                dtype=dtype,
                mode=mode,
                interpret=cfg.interpret_pallas,
            )
            mem = measure.device_memory(f"{__name__}:memory_problem", kwargs)
            row["peak_mib"], row["memory_note"] = mem["peak_mib"], mem["note"]
    return list(rows.values())


def environment() -> dict[str, Any]:
    """What produced the results: versions, backend, device, date and command."""
    import jaxlib

    device = jax.devices()[0]
    return dict(
        jax=jax.__version__,
        jaxlib=jaxlib.__version__,
        backend=jax.default_backend(),
        device_kind=device.device_kind,
        device_count=jax.device_count(),
        date_utc=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        command=" ".join(sys.argv),
    )


def run(cfg: ml_collections.ConfigDict, log=print) -> dict[str, Any]:
    for variant in cfg.variants:
        if variant not in VARIANTS:
            raise ValueError(f"config.variants entries must be in {VARIANTS}, got {variant!r}")
    shapes = [OpShape(*s) for s in cfg.op_shapes]
    cells = [(s, d, m) for s in shapes for d in cfg.dtypes for m in cfg.modes]
    rows = []
    for i, (shape, dtype, mode) in enumerate(cells):
        log(f"[{i + 1}/{len(cells)}] {shape.name} {dtype} {mode}")
        rows += run_cell(shape, dtype, mode, cfg, log=log)
    return dict(environment=environment(), cells=rows)


def markdown(results: dict[str, Any]) -> str:
    env = results["environment"]
    lines = [
        f"GPU benchmark on {env['device_kind']} ({env['backend']}), jax {env['jax']}, "
        f"{env['date_utc']}: `{env['command']}`",
        "",
        "| shape | dtype | mode | variant | time ms | / xla (range) | peak MiB | XLA temp MiB "
        "| rel. diff vs float32 |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    mib = lambda b: "" if b is None else f"{b / 2**20:.0f}"
    for r in results["cells"]:
        head = f"| {r['shape']} | {r['dtype']} | {r['mode']} | {r['variant']} |"
        if "unavailable" in r:
            lines.append(f"{head} {r['unavailable'][:120]} | | | | |")
            continue
        ratio = ""
        if "ratio_to_xla" in r:
            low, high = r["ratio_range"]
            ratio = f"{r['ratio_to_xla']:.2f} ({low:.2f}-{high:.2f})"
        peak = r.get("peak_mib")
        lines.append(
            f"{head} {r['time_ms']:.3g} | {ratio} | {'' if peak is None else f'{peak:.0f}'} | "
            f"{mib(r['temp_bytes'])} | {r['rel_diff_vs_float32']:.1e} |"
        )
    return "\n".join(lines) + "\n"
