"""Benchmark logic behind scripts/benchmark.py: Attention against AF2's Attention and a roofline.

The baseline is AlphaFold 2 as users install it: the alphafold-colabfold package's own modules
(baseline_label() gives the version; run() records it), imported lazily through
gated_attention.af2.af2_package.alphafold_modules(). For each shape x dtype x mode (forward,
forward+backward) the variants are: gated_attention.Attention with each requested implementation,
AF2's Attention (alphafold.model.modules.Attention with model_1's global config, zero_init off; on
CPU it takes AF2's plain XLA 'bqhc' einsum path) or, for triangle cells, AF2's TriangleAttention
(at inference, as installed: rows in subbatches of model_1's subbatch_size, 4), and a same-FLOP
matrix product (the roofline). All variants of a cell share parameters (AF2's
module initializes them; ours take the same tree) and inputs, are compiled first, then timed in
interleaved rounds (each round times every variant `steps` times and keeps the median; the time is
the median over rounds), so that machine load moves every variant alike. The ratio to AF2 is taken
per round (against AF2's time in the same round) and reported as the median over rounds with its
range. XLA's compiled memory analysis is recorded per variant, and the CPU steal share during the
timed rounds per cell.

run() times each cell in a fresh child process (run_cell_in_child, child.py says why); run_cell
itself also runs in-process (the tests).

Op-level memory cases record, forward and forward+backward, XLA's temp bytes of
dot_product_attention compiled on jax.ShapeDtypeStructs and the resident memory of one call in a
fresh process (measure.resident_memory); a goal judges the larger of the two.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import statistics
from collections.abc import Callable, Iterable
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from gated_attention.af2 import af2_package, modules
from gated_attention.af2 import family as alphafold
from gated_attention.attention import api as attention
from gated_attention.core import numerics
from gated_attention_tools import child, family_benchmark, measure

AF2 = "af2"
ROOFLINE = "matmul"
BASELINE_PACKAGE = "alphafold-colabfold"


def baseline_label() -> str:
    """The baseline's package and version, e.g. 'alphafold-colabfold 2.3.27' (from its metadata;
    'not installed' in place of the version when it is missing)."""
    try:
        version = importlib.metadata.version(BASELINE_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        version = "not installed"
    return f"{BASELINE_PACKAGE} {version}"


def _af2_package():
    """(alphafold.model.modules, model_1's global config with zero_init off), imported on first use;
    ImportError saying how to install the package when it is missing."""
    af2_modules = af2_package.alphafold_modules()
    # AF2's own keys (use_pallas, kernel_backend, subbatch_size, ...) as users get them: the
    # package's Attention reads them to pick its path (off a GPU: its plain XLA einsums).
    global_config = family_benchmark.model_config().global_config
    global_config.zero_init = False  # a random output projection: the output depends on every op
    return af2_modules, global_config


@dataclasses.dataclass(frozen=True)
class Shape:
    """One Attention problem: q_data = m_data [batch, length, channels], `num_head` heads.

    Attributes:
      name: label in tables.
      batch, length, channels, num_head: sizes; per-head dim = channels // num_head.
      nonbatched_bias: pass a [h, q, k] bias shared by the batch.
      mask: 'key' ([b, 1, 1, k], 10% masked) or 'none'.
      module: 'attention' (Attention vs AF2's alphafold.model.modules.Attention) or
        'triangle_attention' (alphafold.TriangleAttention vs AF2's modules.TriangleAttention,
        per row, on a [length, length, channels] pair; batch must equal length).
    """

    name: str
    batch: int
    length: int
    channels: int
    num_head: int
    nonbatched_bias: bool = True
    mask: str = "key"
    module: str = "attention"

    def flops(self) -> int:
        """Forward FLOPs: q/k/v/gate projections, the two attention matmuls, the output projection
        (and for triangle attention the pair-bias projection)."""
        n, c = self.length, self.channels
        return measure.attention_flops(
            batch=self.batch,
            num_queries=n,
            num_keys=n,
            q_channels=c,
            m_channels=c,
            key_dim=c,
            value_dim=c,
            output_dim=c,
            num_head=self.num_head,
            gating=True,
            pair_channels=c if self.module == "triangle_attention" else 0,
        )


def _inputs(shape: Shape, dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    b, n, c, h = shape.batch, shape.length, shape.channels, shape.num_head
    x = jnp.asarray(rng.normal(size=(b, n, c)), dtype)
    keep = rng.random((b, 1, 1, n)) > (0.1 if shape.mask == "key" else -1.0)
    if shape.module == "triangle_attention":  # AF2's float pair mask [r, r]
        return x, jnp.asarray(keep[:, 0, 0, :], dtype), None
    bias = jnp.asarray(rng.normal(size=(h, n, n)), dtype) if shape.nonbatched_bias else None
    return x, jnp.asarray(keep), bias


def forward_fns(shape: Shape, implementations: Iterable[str]) -> dict[str, hk.Transformed]:
    """Transformed fns(x, mask, bias) for each implementation of ours and for AF2's Attention
    (alphafold-colabfold's module; AF2 = the key)."""
    h, c = shape.num_head, shape.channels
    triangle = shape.module == "triangle_attention"
    fns = {}
    for name in implementations:

        def ours(x, mask, bias, name=name):
            global_config = dict(zero_init=False, attention_implementation=name, subbatch_size=None)
            if triangle:
                config = dict(num_head=h, orientation="per_row", dropout_rate=0.25)
                return alphafold.TriangleAttention(config, global_config)(x, mask)
            return modules.Attention(dict(num_head=h), global_config, c)(x, x, mask, bias)

        fns[name] = hk.without_apply_rng(hk.transform(ours))

    af2_modules, global_config = _af2_package()
    utils = importlib.import_module("alphafold.model.utils")

    def af2(x, mask, bias):  # AF2's modules, the key mask as AF2's additive bias
        if triangle:
            config = ml_collections.ConfigDict(
                dict(
                    num_head=h,
                    orientation="per_row",
                    gating=True,
                    dropout_rate=0.25,
                    shared_dropout=True,
                )
            )
            return af2_modules.TriangleAttention(config, global_config)(x, mask, is_training=False)
        # [b, 1, 1, k]: 1e9 * (mask - 1), as AF2 builds it (-1e4 in float16, where 1e9 overflows).
        mask_bias = utils.mask_to_bias(mask, x.dtype)
        config = ml_collections.ConfigDict(dict(num_head=h, gating=True))
        return af2_modules.Attention(config, global_config, c)(x, x, mask_bias, bias)

    fns[AF2] = hk.without_apply_rng(hk.transform(af2))
    return fns


def _check_same_params(fns: dict[str, hk.Transformed], params, args) -> None:
    """Raises ValueError unless every variant's parameter tree (structure, shapes, dtypes) is the
    one AF2's module initialized, which all variants share."""
    expected = jax.tree.map(lambda p: (p.shape, p.dtype), params)
    for name, fn in fns.items():
        if name == AF2:
            continue
        spec = jax.eval_shape(fn.init, jax.random.PRNGKey(0), *args)
        got = jax.tree.map(lambda p: (p.shape, p.dtype), spec)
        if got != expected:
            raise ValueError(
                f"variant {name!r} does not take AF2's parameters: its tree {got} differs from "
                f"AF2's {expected}"
            )


def timed_fn(transformed: hk.Transformed, mode: str) -> Callable:
    """fn(params, x, mask, bias): the forward, or with mode 'forward_backward'
    fn(params, x, mask, bias, cotangent): the gradients for the parameters and x of the output with
    that cotangent (an argument, as a model's backward pass receives it: the gradient of
    sum(output) is a constant that XLA can fold into the backward)."""
    if mode == "forward":
        return transformed.apply

    def step(params, x, mask, bias, cotangent):
        _, vjp = jax.vjp(lambda params, x: transformed.apply(params, x, mask, bias), params, x)
        return vjp(cotangent)

    return step


def _roofline(flops: int, dtype, mode: str):
    """A square matmul with the cell's FLOPs (3x for forward+backward), and its arguments."""
    n = max(8, round((flops * (3 if mode == "forward_backward" else 1) / 2) ** (1 / 3)))
    rng = np.random.default_rng(1)
    a = jnp.asarray(rng.normal(size=(n, n)), dtype)
    return (lambda a, b: a @ b), (a, a), 2 * n**3


def _relative_diff(tree, reference_leaves) -> float:
    worst = 0.0
    for a, b in zip(jax.tree.leaves(tree), reference_leaves, strict=True):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        worst = max(worst, float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30)))
    return worst


def run_cell(
    shape: Shape,
    dtype: str,
    mode: str,
    implementations: list[str],
    rounds: int,
    steps: int,
    log: Callable[[str], None] = print,
    baseline_only: bool = False,
) -> list[dict[str, Any]]:
    """Times every variant of one shape x dtype x mode in interleaved rounds; one row per variant.

    baseline_only: AF2 alone (only its program compiled and called in the process, as a user runs
    it; no roofline, no accuracy reference): the baseline check of run().
    """
    x, mask, bias = _inputs(shape, jnp.dtype(dtype))
    fns = forward_fns(shape, [] if baseline_only else implementations)
    params = jax.jit(fns[AF2].init)(jax.random.PRNGKey(0), x, mask, bias)
    _check_same_params(fns, params, (x, mask, bias))
    params = jax.tree.map(lambda p: (p + 0.1).astype(dtype), params)  # a gate that varies
    args = (params, x, mask, bias)
    if mode == "forward_backward":  # a unit-normal cotangent of the output
        rng = np.random.default_rng(2)
        args += (jnp.asarray(rng.normal(size=(*x.shape[:-1], shape.channels)), dtype),)
    variants = {name: (jax.jit(timed_fn(fn, mode)), args) for name, fn in fns.items()}
    flops = shape.flops() * (3 if mode == "forward_backward" else 1)
    mm, mm_args, mm_flops = _roofline(shape.flops(), jnp.dtype(dtype), mode)
    if not baseline_only:
        variants[ROOFLINE] = (jax.jit(mm), mm_args)
    compile_s, temp, outputs = {}, {}, {}
    for name, (fn, args) in variants.items():
        (compile_s[name],), outputs[name] = measure.time_calls(fn, args, 1)  # compiles
        temp[name] = measure.xla_memory(fn, args)["temp_size_in_bytes"]
    # The accuracy reference: AF2's module in float32 on the same (rounded) params and inputs.
    reference = outputs[AF2]
    if jnp.dtype(dtype) != jnp.float32 and not baseline_only:
        reference = jax.jit(timed_fn(fns[AF2], mode))(
            *numerics.cast_floats(variants[AF2][1], jnp.float32)
        )
    reference = jax.tree.leaves(reference)
    per_round = {name: [] for name in variants}
    cpu_before = measure.cpu_ticks()
    for r in range(rounds):
        for name, (fn, args) in variants.items():
            per_round[name].append(statistics.median(measure.time_calls(fn, args, steps)[0]))
        log(f"  {shape.name} {dtype} {mode}: round {r + 1}/{rounds} done")
    steal = measure.steal_percent(cpu_before, measure.cpu_ticks())
    med = {name: statistics.median(ts) for name, ts in per_round.items()}
    roofline_gflops = mm_flops / med.get(ROOFLINE, float("nan")) / 1e9
    rows = []
    for name in variants:
        cell_flops = mm_flops if name == ROOFLINE else flops
        gflops = cell_flops / med[name] / 1e9
        # Each round's ratio to AF2's time in the same round: a slowdown of the whole machine
        # during one round moves both times of that round, not the ratio.
        ratios = [t / t_af2 for t, t_af2 in zip(per_round[name], per_round[AF2], strict=True)]
        rows.append(
            dict(
                shape=shape.name,
                dtype=dtype,
                mode=mode,
                variant=name,
                time_ms=med[name] * 1e3,
                # Same params and inputs: max |x - AF2's float32 x| / max |AF2's float32 x| over
                # every output leaf (the output, or the gradients in forward_backward mode).
                rel_diff_vs_af2_float32=None
                if name == ROOFLINE
                else _relative_diff(outputs[name], reference),
                ratio_to_af2=statistics.median(ratios),
                ratio_range=[min(ratios), max(ratios)],
                gflops_per_s=gflops,
                percent_of_roofline=100 * gflops / roofline_gflops,
                compile_s=compile_s[name],
                temp_bytes=temp[name],
                rounds_ms=[t * 1e3 for t in per_round[name]],
                cpu_steal_percent=steal,
                batch=shape.batch,
                length=shape.length,
                channels=shape.channels,
                num_head=shape.num_head,
            )
        )
    return rows


@dataclasses.dataclass(frozen=True)
class MemoryCase:
    """An op-level memory check: self-attention or a batched (triangle) problem.

    Attributes:
      name: label.
      batch, num_head, length, head_dim: sizes; query, key and value are [batch, length, num_head,
        head_dim].
      shared_bias: add a [1, num_head, length, length] bias shared over the batch (gradient included).
      forward_goal_mib, backward_goal_mib: the goals for the larger of XLA's temp bytes and the
        resident memory.
    """

    name: str
    batch: int
    num_head: int
    length: int
    head_dim: int
    shared_bias: bool
    forward_goal_mib: float
    backward_goal_mib: float


MEMORY_MODES = ("forward", "forward_backward")


def memory_problem(
    case: MemoryCase | dict[str, Any], implementation: str, dtype: str, mode: str
) -> tuple[Callable, tuple[jax.ShapeDtypeStruct | None, ...]]:
    """A memory case's op and its input specs, in dot_product_attention's layout.

    Args:
      case: a MemoryCase, or its fields as a dict (as measure.resident_memory passes them).
      implementation: dot_product_attention's implementation.
      dtype: of query, key, value and the bias.
      mode: 'forward', or 'forward_backward' (the gradients for q, k, v and the bias).

    Returns:
      (fn(q, k, v, bias, mask[, cotangent]), specs): q, k, v [batch, length, num_head,
      head_dim], bias [1, num_head, length, length] or None, mask bool [batch, 1, 1, length]; in
      forward_backward the output's cotangent, q's shape, is an argument too.
    """
    if mode not in MEMORY_MODES:
        raise ValueError(f"mode must be one of {MEMORY_MODES}, got {mode!r}")
    case = case if isinstance(case, MemoryCase) else MemoryCase(**case)
    b, n, t, h = case.batch, case.num_head, case.length, case.head_dim
    spec = lambda shape, dt=dtype: jax.ShapeDtypeStruct(shape, jnp.dtype(dt))
    qkv = spec((b, t, n, h))
    bias = spec((1, n, t, t)) if case.shared_bias else None
    mask = spec((b, 1, 1, t), bool)

    def fwd(q, k, v, bias, mask):
        return attention.dot_product_attention(q, k, v, bias, mask, implementation=implementation)

    def fwd_bwd(q, k, v, bias, mask, cotangent):  # the cotangent an argument, as in a model
        _, vjp = jax.vjp(lambda q, k, v, bias: fwd(q, k, v, bias, mask), q, k, v, bias)
        return vjp(cotangent)

    if mode == "forward":
        return fwd, (qkv, qkv, qkv, bias, mask)
    return fwd_bwd, (qkv, qkv, qkv, bias, mask, qkv)


def memory_case(case: MemoryCase, implementation: str, dtype: str = "float32") -> dict[str, Any]:
    """XLA temp bytes and resident memory of the op, forward and forward+backward.

    The temp bytes come from compiling on jax.ShapeDtypeStructs; the resident memory from one call
    in a fresh process (measure.resident_memory), which also counts what XLA:CPU's temp bytes miss
    (scratch inside fused kernels, layout copies). The goals judge the larger of the two.
    """
    result = dict(
        case=case.name,
        implementation=implementation,
        dtype=dtype,
        forward_goal_mib=case.forward_goal_mib,
        backward_goal_mib=case.backward_goal_mib,
    )
    probes = []
    for mode in MEMORY_MODES:
        fn, specs = memory_problem(case, implementation, dtype, mode)
        temp = measure.xla_memory(jax.jit(fn), specs)["temp_size_in_bytes"]
        result[f"{mode}_temp_mib"] = None if temp is None else temp / 2**20
        probe = measure.resident_memory(
            f"{__name__}:memory_problem",
            dict(
                case=dataclasses.asdict(case), implementation=implementation, dtype=dtype, mode=mode
            ),
        )
        result[f"{mode}_resident_mib"] = probe["resident_mib"]
        probes.append(probe)
    result["resident_peak_reset"] = all(p["peak_reset"] for p in probes)
    result["resident_note"] = probes[0]["note"]
    judged = [_larger(result[f"{m}_temp_mib"], result[f"{m}_resident_mib"]) for m in MEMORY_MODES]
    result["meets_goals"] = (
        None not in judged
        and judged[0] <= case.forward_goal_mib
        and judged[1] <= case.backward_goal_mib
    )
    return result


def _larger(*mib: float | None) -> float | None:
    known = [m for m in mib if m is not None]
    return max(known) if known else None


def check_goals(
    goals, shape_names: Iterable[str], modes: Iterable[str], implementations: Iterable[str]
) -> None:
    """Raises ValueError unless goals are (shape name, ratio > 0) pairs naming swept shapes, and
    the forward mode and the 'auto' implementation they are about are swept (scripts/benchmark.py
    checks this before anything runs)."""
    shape_names, modes, implementations = set(shape_names), tuple(modes), tuple(implementations)
    for goal in goals:
        if (
            not isinstance(goal, (tuple, list))
            or len(goal) != 2
            or not isinstance(goal[1], (int, float))
            or isinstance(goal[1], bool)
            or goal[1] <= 0
        ):
            raise ValueError(
                f"config.goals entries must be (shape name, ratio > 0) pairs, got {goal!r}"
            )
        if goal[0] not in shape_names:
            raise ValueError(
                f"config.goals names shape {goal[0]!r}, which is not swept; swept shapes: "
                f"{sorted(shape_names)}"
            )
    if goals and "forward" not in modes:
        raise ValueError(f"config.goals are forward ratios, but config.modes is {modes}")
    if goals and "auto" not in implementations:
        raise ValueError(
            f"config.goals are about implementation 'auto', but config.implementations is "
            f"{implementations}"
        )


def goal_rows(
    rows: list[dict[str, Any]], goals: Iterable[tuple[str, float]], variant: str = "auto"
) -> list[dict[str, Any]]:
    """The forward ratio goals against `variant`'s rows (the default implementation), per dtype.

    Args:
      rows: run_cell rows.
      goals: (shape name, largest ratio to AF2's time) pairs.
      variant: the implementation the goals are about.

    Returns:
      One dict per goal and dtype measured: shape, dtype, goal, ratio (median of the per-round
      ratios), ratio_range, met (the median is at most the goal).
    """
    out = []
    for shape, goal in goals:
        for r in rows:
            if (r["shape"], r["mode"], r["variant"]) == (shape, "forward", variant):
                out.append(
                    dict(
                        shape=shape,
                        dtype=r["dtype"],
                        goal=float(goal),
                        ratio=r["ratio_to_af2"],
                        ratio_range=r["ratio_range"],
                        met=r["ratio_to_af2"] <= goal,
                    )
                )
    return out


def markdown(
    rows: list[dict[str, Any]],
    memory_rows: list[dict[str, Any]],
    goals: Iterable[tuple[str, float]] = (),
    allocator: dict[str, Any] | None = None,
) -> str:
    """The results as Markdown tables: goals (if any), every cell, memory cases (if any).

    The first line names the baseline (baseline_label(), the version installed). "/ AF2" is the
    median over rounds of each round's time ratio to AF2's Attention (or TriangleAttention), with
    the lowest and highest round in brackets; "steal %" is the share of the machine's CPU time the
    hypervisor took during the cell's timed rounds (Linux only).
    """
    lines = [f"AF2: AlphaFold 2's Attention and TriangleAttention ({baseline_label()})", ""]
    if allocator is not None:
        lines += [measure.allocator_line(allocator, rows, "shape"), ""]
    met = goal_rows(rows, goals)
    if met:
        lines += [
            "| goal shape (forward, 'auto') | dtype | goal: / AF2 at most | / AF2 (rounds) | met |",
            "| --- | --- | ---: | ---: | --- |",
        ]
        for g in met:
            low, high = g["ratio_range"]
            lines.append(
                f"| {g['shape']} | {g['dtype']} | {g['goal']:.2f} | {g['ratio']:.3f} "
                f"({low:.2f}-{high:.2f}) | {'yes' if g['met'] else 'no'} |"
            )
        lines.append("")
    lines += [
        "| shape | dtype | mode | variant | time (ms) | / AF2 (rounds) | GFLOP/s | % roofline "
        "| XLA temp (MiB) | rel. diff vs AF2 float32 | steal % | AF2 alone (ms), harness / alone |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        temp = "" if r["temp_bytes"] is None else f"{r['temp_bytes'] / 2**20:.1f}"
        diff = r.get("rel_diff_vs_af2_float32")
        diff = "" if diff is None else f"{diff:.1e}"
        low, high = r["ratio_range"]
        steal = r.get("cpu_steal_percent")
        steal = "" if steal is None else f"{steal:.0f}"
        lines.append(
            f"| {r['shape']} | {r['dtype']} | {r['mode']} | {r['variant']} | {measure.figure(r['time_ms'])} | "
            f"{r['ratio_to_af2']:.3f} ({low:.2f}-{high:.2f}) | {r['gflops_per_s']:.1f} | "
            f"{r['percent_of_roofline']:.0f} | {temp} | {diff} | {steal} | {measure.alone_cell(r)} |"
        )
    if memory_rows:
        lines += [
            "",
            "| op memory case | implementation | fwd temp (MiB) | fwd resident (MiB) | goal "
            "| fwd+bwd temp (MiB) | fwd+bwd resident (MiB) | goal | met |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        mib = lambda m, key: "" if m[key] is None else f"{m[key]:.1f}"
        for m in memory_rows:
            lines.append(
                f"| {m['case']} | {m['implementation']} | {mib(m, 'forward_temp_mib')} | "
                f"{mib(m, 'forward_resident_mib')} | {m['forward_goal_mib']:.0f} | "
                f"{mib(m, 'forward_backward_temp_mib')} | "
                f"{mib(m, 'forward_backward_resident_mib')} | {m['backward_goal_mib']:.0f} | "
                f"{'yes' if m['meets_goals'] else 'no'} |"
            )
    return "\n".join(lines) + "\n"


def run(cfg: ml_collections.ConfigDict, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Runs configs/benchmark.py's sweep: every cell, each in a fresh process, then the memory cases.

    The goals are checked, and AF2's package imported (ImportError if it is missing), before
    anything runs. Cells are cfg.shapes and the self-attention sweep (1 x L tokens, c=256, 8 heads
    of 32) in every dtype and mode, and cfg.triangle_shapes in float32 forward; each is timed by
    run_cell in a child process of its own (run_cell_in_child; see the module docstring).

    Returns:
      dict(baseline=baseline_label(), goals=goal_rows(...), cells=run_cell rows,
      memory=memory_case rows), JSON-serializable.
    """
    shapes = [Shape(*s) for s in cfg.shapes]
    shapes += [Shape(f"sweep 1x{n} c256 h8", 1, n, 256, 8, False, "key") for n in cfg.sweep_lengths]
    check_goals(cfg.goals, {s.name for s in shapes}, cfg.modes, cfg.implementations)
    af2_package.alphafold_modules()  # the baseline is there before a child process needs it
    cells = [(s, d, m) for s in shapes for d in cfg.dtypes for m in cfg.modes]
    # Family cells: float32 forward (their LayerNorm parameters are float32 in every mode).
    cells += [(Shape(*s), "float32", "forward") for s in cfg.triangle_shapes]
    rows = []
    for i, (shape, dtype, mode) in enumerate(cells):
        log(f"[{i + 1}/{len(cells)}] {shape.name} {dtype} {mode}")
        cell = (shape, dtype, mode, list(cfg.implementations), cfg.rounds, cfg.steps)
        cell_rows = run_cell_in_child(*cell, log=log, allocator=cfg.allocator)
        log(f"  {shape.name} {dtype} {mode}: AF2 alone")
        alone = run_cell_in_child(*cell, log=log, allocator=cfg.allocator, baseline_only=True)
        rows += measure.check_baseline(cell_rows, alone[0]["time_ms"], cfg.baseline_tolerance)
    memory_rows = []
    if cfg.memory_cases:
        for case in memory_goal_cases():
            for impl in ("auto", "chunked"):
                log(f"memory: {case.name} {impl}")
                memory_rows.append(memory_case(case, impl))
    return dict(
        baseline=baseline_label(),
        jax=jax.__version__,
        allocator=dict(policy=cfg.allocator, env=measure.allocator_env(cfg.allocator)),
        goals=goal_rows(rows, cfg.goals),
        cells=rows,
        memory=memory_rows,
    )


def run_cell_in_child(
    shape: Shape,
    dtype: str,
    mode: str,
    implementations: list[str],
    rounds: int,
    steps: int,
    log: Callable[[str], None] = print,
    allocator: str | None = None,
    baseline_only: bool = False,
) -> list[dict[str, Any]]:
    """run_cell's rows, computed in a fresh process under the `allocator` malloc policy
    (child.call; see its docstring for why)."""
    kwargs = dict(
        shape=dataclasses.asdict(shape),
        dtype=dtype,
        mode=mode,
        implementations=list(implementations),
        rounds=rounds,
        steps=steps,
        baseline_only=baseline_only,
    )
    return child.call(f"{__name__}:_run_cell_json", kwargs, log, allocator=allocator)


def _run_cell_json(shape: dict, **kwargs) -> list[dict[str, Any]]:
    """run_cell for child.call: the Shape as a dict, progress printed."""
    return run_cell(Shape(**shape), **kwargs, log=lambda line: print(line, flush=True))


def memory_goal_cases() -> list[MemoryCase]:
    """The op-level memory goals: self-attention at 16,384 tokens, and the triangle shape (1,024
    rows of 1,024 positions) with a bias shared by the rows."""
    return [
        MemoryCase("self-attention 16384 tokens, 8x32, key mask", 1, 8, 16384, 32, False, 256, 512),
        MemoryCase("triangle 1024x1024, 4x32, shared bias", 1024, 4, 1024, 32, True, 512, 1024),
    ]
