"""The family benchmark: AlphaFold 2's own attention modules and EvoformerIteration (the
alphafold-colabfold package, model_1's configs and AF2's global config as they ship) against the
same code with our attention swapped in (gated_attention.af2.af2_package.use_gated_attention).

Cells (configs/benchmark.py:family):
  * each of AF2's five attention modules in inference (is_training=False, AF2's subbatch_size 4)
    and as a training step (is_training=True, forward and backward with the update's cotangent
    passed in, no subbatching), float32 and bfloat16;
  * EvoformerIteration, the same two modes, and AF2's whole model at inference, with AF2's
    attention ('af2'), ours ('ours') and none ('floor': every family module's update is zero, so
    its cost is the rest of the block or model);
  * memory scaling: a training step of TriangleAttention and MSA row attention at growing crops:
    XLA temp bytes (compiled on shapes, nothing run) and resident memory (VmHWM in a fresh process).

On a GPU (configs/benchmark.py:family_gpu) the variants are AF2 plain, AF2 as ColabFold runs
it there ('colabfold': use_pallas, its fused attention, transition, triangle multiplication and
layer-norm kernels), and each of them with our attention swapped in ('ours', 'ours_colabfold'), in
bfloat16, with each variant's peak device memory; a variant that cannot run says why in its row;
and the longest N_res at which each variant's EvoformerIteration inference runs (cfg.longest: a
bounded search, each probe a fresh process).

Every timed cell runs in a fresh process (child.py says why); within it the variants share
random parameters and inputs, are compiled first and timed in interleaved rounds; a ratio is taken
per round against AF2's time in the same round, and reported as the median and range over rounds.
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
import numpy as np

from gated_attention.af2 import af2_package, config
from gated_attention.core import checks, numerics
from gated_attention_tools import af2_model, child, measure

MODULES = ("msa_row", "msa_column", "msa_column_global", "triangle_start", "triangle_end")
AF2, OURS, FLOOR = af2_model.AF2, af2_model.OURS, af2_model.FLOOR
# AF2's whole monomer model (af2_model.py), inference: n_seq MSA clusters, 4 * n_seq extra MSA rows,
# MODEL_TEMPLATES templates, MODEL_RECYCLES recycling iterations after the first.
MODEL, MODEL_TEMPLATES, MODEL_RECYCLES = "model", 4, 1
MODES = ("inference", "training")


@dataclasses.dataclass(frozen=True)
class Cell:
    """One family cell.

    Attributes:
      what: one of MODULES, 'evoformer' (main MSA) / 'extra_evoformer' (extra MSA stack block), or
        MODEL (AF2's whole monomer model with templates and the extra MSA; inference only).
      n_seq: MSA rows (extra MSA rows for msa_column_global); ignored by the triangle modules.
      n_res: residues.
      dtype: 'float32' or 'bfloat16' (activations and parameters; LayerNorm params float32).
      mode: 'inference' or 'training'.
      remat_policy: our modules' global_config.remat_policy (config.REMAT_POLICIES): what their
        row tiles save for the backward pass; AF2's modules save everything.
      memory_budget_mib: our modules' global_config.memory_budget_mib (None: the default), which
        sizes their row tiles: time against memory on a device.
    """

    what: str
    n_seq: int
    n_res: int
    dtype: str
    mode: str
    remat_policy: str = "nothing"
    memory_budget_mib: float | None = None

    @property
    def name(self) -> str:
        rows = "" if self.what.startswith("triangle") else f"{self.n_seq}x"
        saves = "" if self.remat_policy == "nothing" else f" (saving {self.remat_policy})"
        budget = (
            "" if self.memory_budget_mib is None else f" (budget {self.memory_budget_mib:g} MiB)"
        )
        return f"{self.what} {rows}{self.n_res}{saves}{budget}"


def model_config():
    """model_1's model config from the package, global config as it ships."""
    from alphafold.model import config

    return config.model_config("model_1").model


def _channels(what: str, c) -> tuple[int, int]:
    """(msa channels, pair channels) of model_1: c_m 256 (extra MSA c_e 64), c_z 128."""
    c_m = c.embeddings_and_evoformer.msa_channel
    c_e = c.embeddings_and_evoformer.extra_msa_channel
    c_z = c.embeddings_and_evoformer.pair_channel
    return (c_e if what in ("msa_column_global", "extra_evoformer") else c_m), c_z


def _body(
    what: str,
    is_training: bool,
    implementation: str | None = None,
    remat_policy: str = "nothing",
    shard_rows_over: str | None = None,
    memory_budget_mib: float | None = None,
    kernels: bool = False,
) -> Callable[..., Any]:
    """fn(msa, pair, msa_mask, pair_mask) -> the module's update or the block's output, built from
    the package's classes as the caller's modules.py names them when traced; `implementation`
    (our modules' global_config.attention_implementation; None: 'auto'), `remat_policy`,
    `shard_rows_over` and `memory_budget_mib` (theirs too; None: the default) where ours are in;
    `kernels`: ColabFold's GPU kernels on (af2_model.colabfold_kernels)."""
    c = model_config()
    evo, gc = c.embeddings_and_evoformer.evoformer, c.global_config
    if kernels:
        af2_model.colabfold_kernels(gc)
    with gc.unlocked():
        gc.remat_policy = remat_policy
        gc.shard_rows_over = shard_rows_over
        gc.memory_budget_mib = memory_budget_mib
        if implementation is not None:
            gc.attention_implementation = implementation
    modules = af2_package.alphafold_modules()

    def fn(msa, pair, msa_mask, pair_mask):
        if what in ("evoformer", "extra_evoformer"):
            block = modules.EvoformerIteration(evo, gc, is_extra_msa=what == "extra_evoformer")
            return block(
                {"msa": msa, "pair": pair},
                {"msa": msa_mask, "pair": pair_mask},
                is_training=is_training,
            )
        if what == "msa_row":
            m = modules.MSARowAttentionWithPairBias(evo.msa_row_attention_with_pair_bias, gc)
            return m(msa, msa_mask, pair, is_training=is_training)
        if what == "msa_column":
            m = modules.MSAColumnAttention(evo.msa_column_attention, gc)
            return m(msa, msa_mask, is_training=is_training)
        if what == "msa_column_global":
            m = modules.MSAColumnGlobalAttention(evo.msa_column_attention, gc)
            return m(msa, msa_mask, is_training=is_training)
        cfg = evo[f"triangle_attention_{what.split('_')[1]}ing_node"]
        return modules.TriangleAttention(cfg, gc)(pair, pair_mask, is_training=is_training)

    return fn


def transformed(
    what: str,
    variant: str,
    is_training: bool,
    implementation: str | None = None,
    remat_policy: str = "nothing",
    shard_rows_over: str | None = None,
    memory_budget_mib: float | None = None,
) -> hk.Transformed:
    """The cell's function for a variant: AF2's classes, ours swapped in (running
    `implementation`, None: 'auto', with `remat_policy`, `shard_rows_over` and
    `memory_budget_mib`), or attention removed."""
    body = _body(
        what,
        is_training,
        implementation,
        remat_policy,
        shard_rows_over,
        memory_budget_mib,
        kernels=variant in af2_model.KERNELS,
    )
    return hk.transform(af2_model.with_variant(body, variant))


def input_specs(cell: Cell) -> tuple[jax.ShapeDtypeStruct, ...]:
    """(msa, pair, msa_mask, pair_mask) specs: activations and AF2's float masks in cell.dtype."""
    c_msa, c_z = _channels(cell.what, model_config())
    dt = jnp.dtype(cell.dtype)
    s, r = cell.n_seq, cell.n_res
    spec = jax.ShapeDtypeStruct
    return spec((s, r, c_msa), dt), spec((r, r, c_z), dt), spec((s, r), dt), spec((r, r), dt)


def random_params(t: hk.Transformed, specs, seed: int = 3) -> dict[str, Any]:
    """Random parameters of the package's shapes and dtypes (from the traced init, so no RNG
    program is compiled): weights ~ N(0, 1/fan_in), vectors ~ N(0, 0.04), LayerNorm scales ~ 1."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(t.init, jax.random.PRNGKey(0), *specs)

    def draw(path, spec):
        scale = 1 / np.sqrt(spec.shape[0]) if len(spec.shape) > 1 else 0.2
        x = scale * rng.normal(size=spec.shape) + (path[-1].key == "scale")
        return x.astype(spec.dtype)

    # One transfer of NumPy leaves: jnp.asarray(x, dtype) per leaf compiles a copy program per
    # shape and dtype (jax 0.10), hundreds for a model's parameters.
    return jax.device_put(jax.tree_util.tree_map_with_path(draw, shapes))


def random_inputs(specs, seed: int = 0) -> tuple[jax.Array, ...]:
    """Unit-normal activations; masks with 10% of the MSA and 2% of the residues padded."""
    rng = np.random.default_rng(seed)
    msa, pair, msa_mask, pair_mask = specs
    residues = rng.random(pair_mask.shape[0]) > 0.02
    return jax.device_put(
        (
            rng.normal(size=msa.shape).astype(msa.dtype),
            rng.normal(size=pair.shape).astype(pair.dtype),
            ((rng.random(msa_mask.shape) > 0.1) & residues).astype(msa_mask.dtype),
            (residues[:, None] & residues[None, :]).astype(pair_mask.dtype),
        )
    )


def step_fn(t: hk.Transformed, cell_what: str, mode: str) -> Callable:
    """fn(params, msa, pair, msa_mask, pair_mask) -> the output (inference), or
    fn(params, msa, pair, msa_mask, pair_mask, cotangent) -> the gradients for the parameters and
    the activations (training: forward+backward). The update's cotangent is an argument, as a
    model's backward pass receives it: the gradient of sum(update) would be a constant that XLA can
    fold into the backward, a program no model runs."""
    key = jax.random.PRNGKey(1)
    if mode == "inference":
        return lambda params, *args: t.apply(params, key, *args)
    if mode != "training":
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")

    def step(params, msa, pair, msa_mask, pair_mask, cotangent):
        forward = lambda params, msa, pair: t.apply(params, key, msa, pair, msa_mask, pair_mask)
        _, vjp = jax.vjp(forward, params, msa, pair)
        return vjp(cotangent)

    return step


def cotangent(t: hk.Transformed, params, specs, seed: int = 5):
    """A unit-normal cotangent of the update (or the block's outputs), in the output's dtypes."""
    out = jax.eval_shape(lambda p, *a: t.apply(p, jax.random.PRNGKey(1), *a), params, *specs)
    rng = np.random.default_rng(seed)
    return jax.device_put(jax.tree.map(lambda s: rng.normal(size=s.shape).astype(s.dtype), out))


def cotangent_specs(t: hk.Transformed, param_specs, specs):
    """The cotangent's jax.ShapeDtypeStructs (for compiling on shapes)."""
    return jax.eval_shape(lambda p, *a: t.apply(p, jax.random.PRNGKey(1), *a), param_specs, *specs)


def relative_diff(tree, reference) -> float:
    """The largest max|a - b| / max|b| over the leaves (in float32). A leaf whose max|b| is below
    1e-2 of the largest leaf's is measured against that instead: a gradient that is zero in exact
    arithmetic (the pair LayerNorm's offset shifts every logit of a head alike) is rounding noise
    in both, and its ratio would say nothing."""
    pairs = [
        (a.astype(jnp.float32), b.astype(jnp.float32))
        for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(reference), strict=True)
    ]
    scales = [float(jnp.max(jnp.abs(b))) for _, b in pairs]
    floor = max(1e-2 * max(scales), 1e-30)
    return max(
        float(jnp.max(jnp.abs(a - b))) / max(s, floor)
        for (a, b), s in zip(pairs, scales, strict=True)
    )


def cell_problem(cell: Cell, variants: tuple[str, ...]) -> tuple[dict[str, Callable], tuple]:
    """({variant: its step function (step_fn), not jitted}, args): a module or block cell's
    variants on the same random parameters (the first variant's), inputs and, for a training step,
    cotangent."""
    is_training = cell.mode == "training"
    fns = {
        v: transformed(
            cell.what,
            v,
            is_training,
            remat_policy=cell.remat_policy,
            memory_budget_mib=cell.memory_budget_mib,
        )
        for v in variants
    }
    specs = input_specs(cell)
    params = random_params(fns[variants[0]], specs)
    args = (params, *random_inputs(specs))
    if is_training:
        args += (cotangent(fns[variants[0]], params, specs),)
    return {v: step_fn(t, cell.what, cell.mode) for v, t in fns.items()}, args


def run_cell(
    cell: Cell,
    rounds: int,
    steps: int,
    log: Callable[[str], None] = print,
    variants: tuple[str, ...] | None = None,
) -> list:
    """Times AF2, ours (and for the Evoformer the floor) on one cell in interleaved rounds.

    Args:
      variants: None for all of the cell's; (AF2,) times AF2 alone (only its program compiled and
        called in the process, as a user runs it: the baseline check of run()).
    """
    if variants is None:
        with_floor = "evoformer" in cell.what or cell.what == MODEL
        variants = (AF2, OURS, FLOOR) if with_floor else (AF2, OURS)
    if cell.what == MODEL:
        return _model_cell(cell, rounds, steps, log, variants)
    step_fns, args = cell_problem(cell, variants)
    jitted, unavailable = {}, {}
    compile_s, temp, outputs = {}, {}, {}
    for v, fn in step_fns.items():
        start = time.perf_counter()
        try:  # e.g. ColabFold's kernels off a GPU: the variant's row says why
            jitted[v] = jax.jit(fn).lower(*args).compile()  # before any peak is read
        except Exception as e:
            unavailable[v] = _reason(e)
            continue
        compile_s[v] = time.perf_counter() - start
        memory = measure.compiled_memory(jitted[v])
        temp[v] = None if memory is None else memory["temp"]
    peaks = {}
    for v in sorted(jitted, key=lambda v: temp[v] or 0):  # rising: the device's peak reads exact
        peaks[v], outputs[v] = measure.call_peak(lambda v=v: jitted[v](*args))
    reference = outputs.get(AF2)
    if cell.dtype != "float32" and len(variants) > 1:  # AF2 in float32 on the same (rounded) inputs
        reference = jax.jit(step_fns[AF2])(*numerics.cast_floats(args, jnp.float32))
    rows = _timed_rows(cell, jitted, args, rounds, steps, log, compile_s, temp, outputs, reference)
    for row in rows:
        peak = peaks[row["variant"]]
        row.update(peak_mib=_mib(peak["added_bytes"]), peak_exact=peak["exact"])
    return rows + [
        dict(_cell_fields(cell), variant=v, unavailable=why) for v, why in unavailable.items()
    ]


def _reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"


def _mib(n: int | None) -> float | None:
    return None if n is None else n / 2**20


def _cell_fields(cell: Cell) -> dict[str, Any]:
    return dict(
        cell=cell.name, what=cell.what, n_seq=cell.n_seq, n_res=cell.n_res, dtype=cell.dtype,
        mode=cell.mode, remat_policy=cell.remat_policy, memory_budget_mib=cell.memory_budget_mib,
    )  # fmt: skip


def _model_cell(cell: Cell, rounds: int, steps: int, log, variants) -> list:
    """AF2's whole model, AF2's attention against ours and the floor (af2_model.problem): each
    variant is its recycling loop of jitted forwards, so no one program's XLA temp is recorded."""
    if cell.mode != "inference":
        raise ValueError(f"the whole-model cell times inference, got {cell}")
    fns, params, batch = af2_model.problem(
        cell.n_res,
        cell.n_seq,
        4 * cell.n_seq,
        MODEL_TEMPLATES,
        MODEL_RECYCLES,
        cell.dtype,
        variants=variants,
    )
    jitted = {v: fns[v] for v in variants}
    args = (params, batch)
    compile_s, outputs = {}, {}
    for v, fn in jitted.items():
        (compile_s[v],), outputs[v] = measure.time_calls(fn, args, 1)
    temp = dict.fromkeys(variants)
    reference = outputs.get(AF2)
    return _timed_rows(cell, jitted, args, rounds, steps, log, compile_s, temp, outputs, reference)


def _timed_rows(cell, jitted, args, rounds, steps, log, compile_s, temp, outputs, reference):
    """The interleaved rounds of a cell's compiled variants, one row per variant."""
    variants = tuple(jitted)
    per_round = {v: [] for v in variants}
    cpu_before = measure.cpu_ticks()
    for r in range(rounds):
        for v, fn in jitted.items():
            per_round[v].append(statistics.median(measure.time_calls(fn, args, steps)[0]))
        log(f"  {cell.name} {cell.dtype} {cell.mode}: round {r + 1}/{rounds}")
    steal = measure.steal_percent(cpu_before, measure.cpu_ticks())
    rows = []
    for v in variants:
        ratios = [t / a for t, a in zip(per_round[v], per_round[AF2], strict=True)]
        rows.append(
            dict(
                **_cell_fields(cell),
                variant=v,
                time_ms=statistics.median(per_round[v]) * 1e3,
                ratio_to_af2=statistics.median(ratios),
                ratio_range=[min(ratios), max(ratios)],
                rounds_ms=[t * 1e3 for t in per_round[v]],
                temp_mib=None if temp[v] is None else temp[v] / 2**20,
                rel_diff_vs_af2_float32=None
                if v == FLOOR or len(variants) == 1
                else relative_diff(outputs[v], reference),
                compile_s=compile_s[v],
                cpu_steal_percent=steal,
            )
        )
    return rows


# --------------------------------------------------------------------------------------------------
# Memory: a training step's XLA temp bytes (on shapes) and resident memory (fresh process).


def memory_problem(
    what: str,
    variant: str,
    n_seq: int,
    n_res: int,
    dtype: str,
    mode: str,
    implementation: str | None = None,
    shard_rows_over: str | None = None,
    memory_budget_mib: float | None = None,
):
    """(fn, specs) of a cell for measure.resident_memory and deviceless compiles: fn takes the
    parameters' leaves and the inputs (with the update's cotangent in training) as flat
    positional arguments (the child makes every input ones); the parameters come first."""
    cell = Cell(what, n_seq, n_res, dtype, mode)
    # Shapes from the unsharded program (the same parameters and update): shard_rows_over's
    # needs the mesh its caller compiles under.
    plain = transformed(what, variant, mode == "training", implementation)
    specs = input_specs(cell)
    shapes = jax.eval_shape(plain.init, jax.random.PRNGKey(0), *specs)
    if mode == "training":
        specs += (cotangent_specs(plain, shapes, specs),)
    leaves, treedef = jax.tree.flatten(shapes)
    in_leaves, in_treedef = jax.tree.flatten(specs)
    t = transformed(
        what, variant, mode == "training", implementation, "nothing", shard_rows_over,
        memory_budget_mib,
    )  # fmt: skip
    step = step_fn(t, what, mode)

    def fn(*flat):
        params = jax.tree.unflatten(treedef, flat[: len(leaves)])
        return step(params, *jax.tree.unflatten(in_treedef, flat[len(leaves) :]))

    return fn, (*leaves, *in_leaves)


def memory_cell(
    what: str, variant: str, n_seq: int, n_res: int, dtype: str, mode: str, resident: bool
) -> dict[str, Any]:
    """XLA temp MiB (compiled on shapes) and, when `resident`, the resident MiB and the time of one
    call in a fresh process."""
    fn, specs = memory_problem(what, variant, n_seq, n_res, dtype, mode)
    temp = measure.xla_memory(jax.jit(fn), specs)["temp_size_in_bytes"]
    row = dict(
        what=what,
        variant=variant,
        n_seq=n_seq,
        n_res=n_res,
        dtype=dtype,
        mode=mode,
        temp_mib=None if temp is None else temp / 2**20,
        resident_mib=None,
    )
    if resident:
        kwargs = dict(what=what, variant=variant, n_seq=n_seq, n_res=n_res, dtype=dtype, mode=mode)
        probe = measure.resident_memory(f"{__name__}:memory_problem", kwargs)
        row.update(resident_mib=probe["resident_mib"], resident_note=probe["note"])
    return row


# --------------------------------------------------------------------------------------------------
# The sweep.


def run(cfg, log: Callable[[str], None] = print) -> dict[str, Any]:
    """configs/benchmark.py's family preset: every cell in a fresh process under cfg.allocator's
    malloc policy, each checked against AF2 timed alone in another fresh process (same policy);
    then memory scaling."""
    from importlib import metadata

    for policy in cfg.remat_policies:
        checks.check_one_of("config.remat_policies entries", policy, config.REMAT_POLICIES)
    for budget in cfg.memory_budgets_mib:
        if budget is not None:
            checks.check_positive_number("config.memory_budgets_mib entries", budget)
    cells = []
    for what, n_seq, n_res in cfg.family_shapes:
        if what == MODEL:  # AF2's whole model: inference, cfg.model_dtype
            cells.append(Cell(what, n_seq, n_res, cfg.model_dtype, "inference"))
            continue
        cells += [
            Cell(what, n_seq, n_res, d, m, policy, budget)
            for d in cfg.dtypes
            for m in cfg.modes
            for policy in (cfg.remat_policies if m == "training" else ("nothing",))
            for budget in cfg.memory_budgets_mib
        ]
    rows = []
    for i, cell in enumerate(cells):
        log(f"[{i + 1}/{len(cells)}] {cell.name} {cell.dtype} {cell.mode}")
        kwargs = dict(cell=dataclasses.asdict(cell), rounds=cfg.rounds, steps=cfg.steps)
        variants = list(cfg.family_variants) or None  # None: the cell's defaults
        try:  # a cell that fails (out of memory on a device) is a row, and the run goes on
            cell_rows = child.call(
                f"{__name__}:_cell", kwargs | dict(variants=variants), log, allocator=cfg.allocator
            )
        except RuntimeError as e:
            rows += [dict(_cell_fields(cell), variant="all", unavailable=_reason(e))]
            continue
        if not cfg.baseline_check:  # a device: no allocator to check
            rows += cell_rows
            continue
        log(f"  {cell.name}: AF2 alone")
        alone = child.call(
            f"{__name__}:_cell", kwargs | dict(variants=[AF2]), log, allocator=cfg.allocator
        )
        rows += measure.check_baseline(cell_rows, alone[0]["time_ms"], cfg.baseline_tolerance)
    fit = []
    for what, n_seq, start, limit, step in cfg.longest:
        for variant in cfg.family_variants or (AF2, OURS):
            log(f"longest: {what} {variant}, from N_res {start} to {limit}")
            found = longest(what, variant, n_seq, start, limit, step, cfg.dtypes[0], log=log)
            fit.append(dict(what=what, variant=variant, n_seq=n_seq, dtype=cfg.dtypes[0], **found))
    memory = []
    for what, n_seq, n_res, variants in cfg.memory_scaling:
        for variant in variants:
            log(f"memory: {what} {n_seq}x{n_res} {variant}")
            kwargs = dict(
                what=what,
                variant=variant,
                n_seq=n_seq,
                n_res=n_res,
                dtype="float32",
                mode="training",
                resident=n_res <= cfg.resident_max_n_res.get(variant, 0),
            )
            memory.append(memory_cell(**kwargs))
    return dict(
        baseline=f"alphafold-colabfold {metadata.version('alphafold-colabfold')}",
        jax=jax.__version__,
        allocator=dict(policy=cfg.allocator, env=measure.allocator_env(cfg.allocator)),
        cells=rows,
        memory=memory,
        longest=fit,
        goals=goal_rows(rows, memory, cfg.goals),
    )


def fits(what: str, variant: str, n_seq: int, n_res: int, dtype: str, mode: str) -> bool:
    """One call of the cell's step for the variant (a child's function): True when it ran; out
    of memory or any other failure ends the child, which the caller reads as 'does not fit'."""
    cell = Cell(what, n_seq, n_res, dtype, mode)
    step_fns, args = cell_problem(cell, (variant,))
    jax.block_until_ready(jax.jit(step_fns[variant])(*args))
    return True


def longest(
    what: str,
    variant: str,
    n_seq: int,
    start: int,
    limit: int,
    step: int,
    dtype: str = "bfloat16",
    mode: str = "inference",
    probe: Callable[[int], bool] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The longest N_res (a multiple of `step`, at most `limit`) at which the variant's cell
    runs, each probe a fresh process (`probe(n_res)` for tests): doubling from `start`, then
    halving the interval. {longest (None: not even `start`), limit_reached, probes}."""
    if probe is None:
        kwargs = dict(what=what, variant=variant, n_seq=n_seq, dtype=dtype, mode=mode)

        def probe(n_res: int) -> bool:
            try:
                return child.call(f"{_MODULE}:fits", kwargs | dict(n_res=n_res), lambda s: None)
            except RuntimeError:
                return False

    probes = {}

    def ok(n: int) -> bool:
        if n not in probes:  # each N_res probed once (a fresh process each)
            probes[n] = probe(n)
        log(f"  {what} {variant} N_res {n}: {'fits' if probes[n] else 'does not fit'}")
        return probes[n]

    if not ok(start):
        return dict(longest=None, limit_reached=False, probes=probes)
    low, high = start, None
    while high is None:
        n = min(2 * low, limit)
        if n == low:
            return dict(longest=low, limit_reached=True, probes=probes)
        low, high = (n, None) if ok(n) else (low, n)
    while high - low > step:
        mid = (low + high) // 2 // step * step
        if mid <= low:
            break
        low, high = (mid, high) if ok(mid) else (low, mid)
    return dict(longest=low, limit_reached=False, probes=probes)


_MODULE = "gated_attention_tools.family_benchmark"  # children import it by name


def _cell(cell: dict, rounds: int, steps: int, variants: list[str] | None = None) -> list:
    """run_cell for child.call: the Cell as a dict, progress printed."""
    return run_cell(
        Cell(**cell),
        rounds,
        steps,
        log=lambda s: print(s, flush=True),
        variants=None if variants is None else tuple(variants),
    )


def goal_rows(rows, memory, goals) -> list[dict[str, Any]]:
    """Each goal with its figure: ('time', what, mode, dtype, ratio) against 'ours' rows (every
    cell of that module, mode and dtype), ('memory', what, n_seq, n_res, mib) against the larger of
    XLA temp and resident memory of our training step."""
    out = []
    for goal in goals:
        if goal[0] == "time":
            _, what, mode, dtype, limit = goal
            for r in rows:
                if (r["what"], r["mode"], r["dtype"], r["variant"]) == (what, mode, dtype, OURS):
                    out.append(
                        dict(
                            goal=f"{r['cell']} {mode} {dtype}: <= {limit:.2f}x AF2",
                            what=what,
                            mode=mode,
                            limit=limit,
                            figure=r["ratio_to_af2"],
                            range=r["ratio_range"],
                            met=r["ratio_to_af2"] <= limit,
                        )
                    )
        else:
            _, what, n_seq, n_res, limit = goal
            for m in memory:
                if (m["what"], m["n_seq"], m["n_res"], m["variant"]) == (what, n_seq, n_res, OURS):
                    known = [x for x in (m["temp_mib"], m["resident_mib"]) if x is not None]
                    figure = max(known) if known else None
                    out.append(
                        dict(
                            goal=f"{what} {n_seq}x{n_res} training step: <= {limit:.0f} MiB",
                            figure=figure,
                            range=None,
                            met=figure is not None and figure <= limit,
                        )
                    )
    return out


def markdown(results: dict[str, Any]) -> str:
    """Goals, cells and memory scaling as Markdown tables."""
    lines = [f"Baseline: {results['baseline']} (jax {results['jax']}).", ""]
    if "allocator" in results:
        lines += [measure.allocator_line(results["allocator"], results["cells"], "cell"), ""]
    if results["goals"]:
        lines += ["| goal | figure | met |", "| --- | ---: | --- |"]
        for g in results["goals"]:
            fig = "" if g["figure"] is None else f"{g['figure']:.3g}"
            if g["range"]:
                fig += f" ({g['range'][0]:.2f}-{g['range'][1]:.2f})"
            lines.append(f"| {g['goal']} | {fig} | {'yes' if g['met'] else 'no'} |")
        lines.append("")
    lines += [
        "| cell | dtype | mode | variant | time (ms) | / AF2 (rounds) | XLA temp (MiB) "
        "| peak (MiB) | rel. diff vs AF2 float32 | steal % | AF2 alone (ms), harness / alone |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results["cells"]:
        if "unavailable" in r:
            head = f"| {r['cell']} | {r['dtype']} | {r['mode']} | {r['variant']} |"
            lines.append(f"{head} {r['unavailable'][:160]} | | | | | | |")
            continue
        low, high = r["ratio_range"]
        peak = "" if r.get("peak_mib") is None else f"{r['peak_mib']:.0f}"
        peak = "~" + peak if peak and r.get("peak_exact") is False else peak
        temp = "" if r["temp_mib"] is None else f"{r['temp_mib']:.0f}"
        diff = r["rel_diff_vs_af2_float32"]
        steal = r["cpu_steal_percent"]
        lines.append(
            f"| {r['cell']} | {r['dtype']} | {r['mode']} | {r['variant']} | {measure.figure(r['time_ms'])} | "
            f"{r['ratio_to_af2']:.3f} ({low:.2f}-{high:.2f}) | {temp} | {peak} | "
            f"{'' if diff is None else f'{diff:.1e}'} | {'' if steal is None else f'{steal:.0f}'} | "
            f"{measure.alone_cell(r)} |"
        )
    if results.get("longest"):
        lines += [
            "",
            "| longest N_res that runs (inference) | variant | N_res |",
            "| --- | --- | ---: |",
        ]
        for f in results["longest"]:
            n = "none" if f["longest"] is None else f"{f['longest']:,}"
            n += " (the search's limit)" if f["limit_reached"] else ""
            lines.append(f"| {f['what']} {f['n_seq']}x, {f['dtype']} | {f['variant']} | {n} |")
    if results["memory"]:
        lines += [
            "",
            "| training step, float32 | variant | XLA temp (MiB) | resident (MiB) |",
            "| --- | --- | ---: | ---: |",
        ]
        for m in results["memory"]:
            rows = "" if m["what"].startswith("triangle") else f"{m['n_seq']}x"
            res = "" if m["resident_mib"] is None else f"{m['resident_mib']:.0f}"
            lines.append(
                f"| {m['what']} {rows}{m['n_res']} | {m['variant']} | {m['temp_mib']:.0f} | {res} |"
            )
    return "\n".join(lines) + "\n"
