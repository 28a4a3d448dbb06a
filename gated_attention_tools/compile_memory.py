"""Device memory of programs compiled deviceless: XLA's real GPU and TPU compilers on this CPU
machine (targets.py) compile each cell in a child process; memory_analysis gives the peak a device
holds (arguments + outputs + temporaries). Nothing runs: no time is measured. Placements:

- 'one_device': AF2's attention family and EvoformerIteration, inference (the update) or training
  step (the gradients, the update's cotangent an argument): 'af2' (AF2's module as installed),
  'ours' (the target's 'auto' choice), 'ours:<implementation>', and for the EvoformerIteration
  'floor' (the block with attention removed). Crops grow until a program no longer fits: the
  tables say the longest crop each variant trains or infers on one device.
- 'rows': the same with the rows (the MSA's sequences, the pair's first residue axis) split over a
  mesh of GPUs or TPU chips: 'ours' (global_config.shard_rows_over), or 'af2' / 'floor' left to
  XLA's partitioner, under mesh axes of type Auto (jax.jit with sharded inputs: how most users
  shard, and the only way AF2's own code can be) or Explicit. Parameters replicated.
- 'keys' (context parallelism): dot_product_attention with the query and key positions split over
  the mesh, 'ring' (shard_keys_over: key blocks passed around, merged by log-sum-exp) or 'plain'
  (left to XLA's partitioner); TriangleAttention (model_1's config) with the pair [N, N, 128] tiled
  over a 2D grid, 'grid' (shard_rows_over x shard_columns_over) or 'plain'.

A mesh cell's ideal: the same program compiled for one device, its peak / the device count.

  python scripts/benchmark.py --config=configs/benchmark.py:device_memory   # one H100, one v5e
  python scripts/benchmark.py --config=configs/benchmark.py:mesh_memory     # rows over 8 devices
  python scripts/benchmark.py --config=configs/benchmark.py:context_memory  # keys over 8 devices
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import haiku as hk
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gated_attention as ga
from gated_attention_tools import family_benchmark, measure, targets

PLACEMENTS = ("one_device", "rows", "keys")
WHATS = (*family_benchmark.MODULES, "evoformer")
OP = "attention"  # a cell's `what`: dot_product_attention itself
PAIR_CHANNELS = 128  # model_1's c_z
EXTRA_MSA_CHANNELS = 64  # model_1's c_e


@dataclasses.dataclass(frozen=True)
class Cell:
    """One compile. `variant`: one_device 'af2', 'floor', 'ours' ('auto') or 'ours:<impl>'; rows
    'ours', 'af2' or 'floor'; keys 'ring' or 'plain' (the op), 'grid' or 'plain' (the pair)."""

    placement: str  # 'one_device', 'rows' or 'keys'
    target: str
    what: str  # a family module, 'evoformer' or OP
    variant: str
    n_res: int  # the op's tokens
    n_seq: int
    dtype: str
    mode: str  # 'training' or 'inference'
    mesh: tuple[int, ...] = ()  # devices per mesh axis; () on one device
    style: str = "auto"  # rows: the mesh axes' type, 'auto' or 'explicit'
    memory_budget_mib: float | None = None  # rows, ours: global_config.memory_budget_mib
    heads: int = 0  # the op's
    head_dim: int = 0
    is_causal: bool = False
    key_bias: bool = False  # a [B, 1, 1, S] bias (keys only: it travels with them)

    @property
    def devices(self) -> int:
        return math.prod(self.mesh)


class Problem(NamedTuple):
    """fn at abstract args; on a mesh, a PartitionSpec per arg (all its leaves), one per output
    (from its ShapeDtypeStruct), the axes' names, and the sizes the summaries divide by."""

    fn: Callable
    args: list
    specs: list
    out_spec: Callable
    axes: tuple[str, ...]
    sizes: dict[str, int]


def problem(cell: Cell) -> Problem:
    if cell.what == OP:
        return _op_problem(cell)
    return _grid_problem(cell) if cell.placement == "keys" else _family_problem(cell)


def _family_problem(cell: Cell) -> Problem:
    """A family module's (family_benchmark.memory_problem): rows split over the 'rows' axis."""
    family, _, implementation = cell.variant.partition(":")
    rows = "rows" if cell.placement == "rows" and family == "ours" else None
    fn, specs = family_benchmark.memory_problem(
        cell.what, family, cell.n_seq, cell.n_res, cell.dtype, cell.mode,
        implementation=implementation or None, shard_rows_over=rows,
        memory_budget_mib=cell.memory_budget_mib,
    )  # fmt: skip
    inputs = len(specs) - (5 if cell.mode == "training" else 4)  # the parameters come first
    split = lambda s: s.shape[0] % cell.devices == 0
    # The outputs split as the inputs of their shape (the update, the activations' gradients; a
    # gradient of zeros for an input the module does not read too), the parameters' replicated:
    # left to XLA under Auto axes, such zeros come out whole on every device.
    shapes = {tuple(s.shape) for s in specs[inputs:] if split(s)}
    arg_specs = [P("rows") if i >= inputs and split(s) else P() for i, s in enumerate(specs)]
    sizes = dict(
        pair_bytes=cell.n_res**2 * PAIR_CHANNELS * jnp.dtype(cell.dtype).itemsize,
        input_bytes=max(math.prod(s.shape) * s.dtype.itemsize for s in specs[inputs:]),
    )
    out_spec = lambda o: P("rows") if tuple(o.shape) in shapes else P()
    return Problem(fn, list(specs), arg_specs, out_spec, ("rows",), sizes)


def _op_problem(cell: Cell) -> Problem:
    """The op's call or training step (the output's cotangent an argument), split along keys."""
    dtype = jnp.dtype(cell.dtype)
    qkv = jax.ShapeDtypeStruct((1, cell.n_res, cell.heads, cell.head_dim), dtype)
    ring = "keys" if cell.variant == "ring" and cell.mesh else None

    def fn(q, k, v, *bias):
        return ga.dot_product_attention(
            q, k, v, bias[0] if bias else None, is_causal=cell.is_causal, shard_keys_over=ring
        )

    args, dims = [qkv, qkv, qkv], [1, 1, 1]
    if cell.key_bias:
        args, dims = [*args, jax.ShapeDtypeStruct((1, 1, 1, cell.n_res), dtype)], [*dims, 3]
    if cell.mode == "training":
        attend = fn

        def fn(*args):
            out, vjp = jax.vjp(attend, *args[:-1])
            return out, vjp(args[-1])

        args, dims = [*args, qkv], [*dims, 1]
    split = lambda d: P(*([None] * d), "keys")
    out_spec = lambda o: split(1 if o.ndim == 4 and o.shape[1] == cell.n_res else 3)
    kv_shard = 2 * math.prod(qkv.shape) * dtype.itemsize // cell.devices
    return Problem(
        fn, args, [split(d) for d in dims], out_spec, ("keys",), dict(kv_shard_bytes=kv_shard)
    )


def _grid_problem(cell: Cell) -> Problem:
    """A family module (model_1's config) with its input tiled over a (rows, cols) grid:
    TriangleAttention on the pair [N, N, 128], MSA column global attention on the extra MSA
    [n_seq, N, 64]."""
    gc = dict(shard_rows_over="rows", shard_columns_over="cols") if cell.variant == "grid" else {}
    training, n = cell.mode == "training", cell.n_res
    if cell.what == "msa_column_global":
        config = dict(num_head=8, orientation="per_column")
        module, shape = ga.MSAColumnGlobalAttention, (cell.n_seq, n, EXTRA_MSA_CHANNELS)
    else:
        orientation = "per_row" if cell.what == "triangle_start" else "per_column"
        config = dict(num_head=4, orientation=orientation, dropout_rate=0.25)
        module, shape = ga.TriangleAttention, (n, n, PAIR_CHANNELS)
    t = hk.transform(lambda x, mask: module(config, gc)(x, mask, training))
    dtype = jnp.dtype(cell.dtype)
    x = jax.ShapeDtypeStruct(shape, dtype)
    mask = jax.ShapeDtypeStruct(shape[:2], dtype)
    params = jax.eval_shape(t.init, jax.random.PRNGKey(0), x, mask)
    key = jax.random.PRNGKey(1)
    if training:

        def fn(p, x, m, cot):
            out, vjp = jax.vjp(lambda p, x: t.apply(p, key, x, m), p, x)
            return out, vjp(cot)

        args = [params, x, mask, x]
    else:
        fn, args = (lambda p, x, m: t.apply(p, key, x, m)), [params, x, mask]
    tile = P("rows", "cols")
    share = math.prod(shape) * dtype.itemsize // cell.devices
    out_spec = lambda o: tile if o.shape[:2] == shape[:2] else P()
    specs = [P(), *[tile] * (len(args) - 1)]
    return Problem(fn, args, specs, out_spec, ("rows", "cols"), dict(pair_share=share))


def _compile(cell: Cell, p: Problem):
    if not cell.mesh:
        return targets.compile(p.fn, *p.args, target=cell.target)
    axis_type = AxisType.Explicit if cell.style == "explicit" else AxisType.Auto
    mesh = targets.mesh(cell.target, cell.mesh, p.axes, axis_type)
    on = lambda spec: NamedSharding(mesh, spec)
    placed = [
        jax.tree.map(lambda a, s=s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on(s)), arg)
        for arg, s in zip(p.args, p.specs, strict=True)
    ]
    with jax.set_mesh(mesh):
        outs = jax.tree.map(lambda o: on(p.out_spec(o)), jax.eval_shape(p.fn, *placed))
        return jax.jit(p.fn, out_shardings=outs).lower(*placed).compile()


def compile_cell(**fields) -> dict[str, Any]:
    """The child: one cell compiled for its target, one device or a mesh; its memory (per device),
    collectives (on a mesh), what 'auto' chose there, or the error."""
    cell = Cell(**{**fields, "mesh": tuple(fields.get("mesh", ()))})
    p = problem(cell)
    start = time.perf_counter()
    try:
        with ga.record_implementation_choices() as choices:
            compiled = _compile(cell, p)
    except Exception as e:  # AF2's einsums under explicit axes, say: reported, not fatal
        if not cell.mesh:
            raise  # the parent records its last line (a TPU's RESOURCE_EXHAUSTED: does not fit)
        return dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
    kind = targets.target(cell.target).kind
    # Calls traced in another platform's branch (the host's, staged beside it) are not this one's.
    chosen = sorted({c["by_platform"][kind]["chosen"] for c in choices if kind in c["by_platform"]})
    out = dict(p.sizes, memory=measure.compiled_memory(compiled), chosen=chosen)
    if cell.mesh:
        out["collectives"] = targets.collectives(compiled)
    return out | dict(compile_s=round(time.perf_counter() - start, 1))


def _in_child(cell: Cell, log) -> dict[str, Any]:
    """compile_cell in a child process; whether the peak fits the device, or the error."""
    try:
        got = targets.in_child(f"{__name__}:compile_cell", dataclasses.asdict(cell), log)
    except RuntimeError as e:  # a compiler's crash or error: its stderr's last line
        return dict(error=str(e).strip().splitlines()[-1][:300])
    if "memory" in got:
        got["fits"] = got["memory"]["peak"] <= targets.target(cell.target).memory_bytes
    return got


def summarize(row: dict[str, Any], one: dict[str, Any] | None = None) -> dict[str, Any]:
    """A row with its ratios. rows: the peak over the ideal (`one`, the one-device compile's
    result: its peak / devices) and the largest all-gather against the largest input (the MSA or
    the pair, whole). keys, the op: the peak over the ideal, the goal's allowance (1.3x ideal + one
    K/V shard in flight), the largest all-gather in K shards. keys, the pair: the peak over the
    device's share of the pair, the largest all-gather."""
    if "error" in row or row["placement"] == "one_device":
        return row
    devices, one = math.prod(row["mesh"]), one or {}
    largest = targets.largest_gather(row["collectives"])
    if row["placement"] == "rows":
        ideal = one["memory"]["peak"] / devices if "memory" in one else None
        return row | dict(
            over_ideal=None if ideal is None else row["memory"]["peak"] / ideal,
            one_device_peak=one.get("memory", {}).get("peak"),
            largest_gather_over_input=largest / row["input_bytes"],
            all_to_all=len(row["collectives"]["all-to-all"]),
        )
    if row["what"] != OP:
        return row | dict(
            over_share=row["memory"]["peak"] / row["pair_share"], largest_gather=largest
        )
    if "memory" not in one:
        return row | dict(error=one.get("error", "no one-device peak"))
    ideal = one["memory"]["peak"] / devices
    return row | dict(
        one_device_peak=one["memory"]["peak"],
        over_ideal=row["memory"]["peak"] / ideal,
        allowance=1.3 * ideal + row["kv_shard_bytes"],
        largest_gather_over_k_shard=largest / (row["kv_shard_bytes"] / 2),
        permutes=len(row["collectives"]["collective-permute"]),
    )


Group = tuple[Cell | None, list[Cell], bool]  # (the ideal or None, the cells, crops that grow)


def _one_device(c) -> Iterator[Group]:
    for target, what, dtype, mode in itertools.product(c.targets, c.whats, c.dtypes, c.modes):
        n_seq = c.extra_msa_rows if what == "msa_column_global" else c.msa_rows
        extra = [f"ours:{name}" for name in c.implementations.get(targets.target(target).kind, ())]
        for variant in ["af2", "ours", *extra, *(["floor"] if what == "evoformer" else [])]:
            cell = Cell("one_device", target, what, variant, 0, n_seq, dtype, mode)
            yield None, [dataclasses.replace(cell, n_res=n) for n in c.crops], True


def _rows(c) -> Iterator[Group]:
    for target, what, dtype, mode in itertools.product(c.targets, c.whats, c.dtypes, c.modes):
        n_seq, n_res = dict(c.crops)[what]
        for variant in c.variants:
            one = Cell("one_device", target, what, variant, n_res, n_seq, dtype, mode)
            over = dict(placement="rows", mesh=(c.devices,), memory_budget_mib=c.memory_budget_mib)
            yield one, [dataclasses.replace(one, style=s, **over) for s in c.styles], False


def _keys(c) -> Iterator[Group]:
    plain = [("h100", *g) for g in c.grid_plain]  # the same pair left to XLA: the baseline
    grid = itertools.product(c.grid_targets, c.grid_whats, c.grid_crops)
    for target, what, (mode, n_res), *variant in [*grid, *plain]:
        n_seq = c.grid_extra_msa_rows if what == "msa_column_global" else 1
        cell = Cell("keys", target, what, *(variant or ["grid"]), n_res, n_seq, c.dtypes[0], mode)
        yield None, [dataclasses.replace(cell, mesh=tuple(c.grid))], False
    for target, dtype, mode, causal in itertools.product(c.targets, c.dtypes, c.modes, c.causal):
        one = Cell(
            "one_device", target, OP, "ring", c.tokens, 1, dtype, mode, heads=c.heads,
            head_dim=c.head_dim, is_causal=causal, key_bias=c.key_bias,
        )  # fmt: skip
        over = dict(placement="keys", mesh=(c.devices,))
        yield one, [dataclasses.replace(one, variant=v, **over) for v in c.variants], False


GROUPS = dict(one_device=_one_device, rows=_rows, keys=_keys)


def run(cfg, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every cell of cfg.placements (each configured by cfg.<placement>_cells), each group after
    its ideal (the one-device compile its ratios are against); growing crops stop at the first
    that does not fit."""
    rows = []
    for placement in cfg.placements:
        for ideal, cells, grow in GROUPS[placement](cfg[f"{placement}_cells"]):
            one = None if ideal is None else _in_child(ideal, log)
            for cell in cells:
                row = summarize(dataclasses.asdict(cell) | _in_child(cell, log), one)
                rows.append(row)
                log(_line(row))
                if grow and not row.get("fits"):
                    break
    grid = [r for r in rows if r["placement"] == "keys" and r["what"] != OP]
    used = dict.fromkeys(r["target"] for r in rows)
    return dict(
        suite="compile_memory",
        placements=list(cfg.placements),
        versions=dict(jax=jax.__version__, jaxlib=jax.lib.__version__),
        targets={t: dataclasses.asdict(targets.target(t)) for t in used},
        config={p: cfg[f"{p}_cells"].to_dict() for p in cfg.placements},
        rows=rows,
        longest=longest_fitting(grid),
    )


def longest(rows, **where) -> int | None:
    """The longest crop that fits among rows matching `where` (None: none fits)."""
    fits = [r["n_res"] for r in rows if r.get("fits") and all(r[k] == v for k, v in where.items())]
    return max(fits) if fits else None


def longest_fitting(rows) -> list[dict[str, Any]]:
    """Per target, module, variant and mode: the longest N_res whose peak fits the device."""
    names = ("target", "what", "variant", "mode")
    keys = dict.fromkeys(tuple(r[k] for k in names) for r in rows if r.get("fits"))
    where = [dict(zip(names, k, strict=True)) for k in keys]
    return [w | dict(n_res=longest(rows, **w)) for w in where]


def _line(r: dict[str, Any]) -> str:
    style = r["style"] if r["placement"] == "rows" else "causal" if r["is_causal"] else ""
    parts = (
        r["placement"],
        r["target"],
        f"x{math.prod(r['mesh'])}",
        r["what"],
        r["variant"],
        style,
    )
    shape = f"{r['n_res']} tokens" if r["what"] == OP else f"{r['n_seq']}x{r['n_res']}"
    head = " ".join(p for p in (*parts, shape, r["dtype"], r["mode"]) if p)
    if "error" in r:
        return f"{head}: {r['error']}"
    ratio = next((f" {r[k]:.2f}x {k[5:]}," for k in ("over_ideal", "over_share") if r.get(k)), "")
    return (
        f"{head}: peak {r['memory']['peak'] / 2**30:.3f} GiB a device,{ratio} temp "
        f"{r['memory']['temp'] / 2**30:.3f} GiB ({','.join(r['chosen'])}; {r['compile_s']} s)"
    )


def markdown(results: dict[str, Any]) -> str:
    """A section of tables per placement, in the order run."""
    by = {p: [r for r in results["rows"] if r["placement"] == p] for p in results["placements"]}
    return "\n".join(TABLES[p](results, by[p]) for p in results["placements"])


def _one_device_tables(results: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    config = results["config"]["one_device"]
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    lines = [
        "# Device memory per target (deviceless compiles; no time measured)",
        "",
        f"jax {results['versions']['jax']}; MSA {config['msa_rows']} rows, extra MSA "
        f"{config['extra_msa_rows']} rows; peak = arguments + outputs + temporaries.",
        "",
        "## Longest crop that fits one device (of the crops compiled)",
        "",
        "| target | module | dtype | mode | " + " | ".join(variants) + " |",
        "| --- | --- | --- | --- | " + " | ".join("---:" for _ in variants) + " |",
    ]
    for target, what, dtype, mode in dict.fromkeys(
        (r["target"], r["what"], r["dtype"], r["mode"]) for r in rows
    ):
        cells = []
        for variant in variants:
            where = dict(target=target, what=what, dtype=dtype, mode=mode, variant=variant)
            tried = [r for r in rows if all(r[k] == v for k, v in where.items())]
            best = longest(rows, **where)
            more = bool(tried) and tried[-1].get("fits", False)  # never ran out of memory
            text = "none" if best is None else f">= {best}" if more else str(best)
            cells.append(text if tried else "")
        lines.append(f"| {target} | {what} | {dtype} | {mode} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Every compile (GiB; temp/pair: temporaries over the pair's own size)",
        "",
        "| target | module | variant | N_res | dtype | mode | chosen | peak | temp | temp/pair |",
        "| --- | --- | --- | ---: | --- | --- | --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        head = f"| {r['target']} | {r['what']} | {r['variant']} | {r['n_res']} | {r['dtype']} | "
        if "error" in r:
            lines.append(f"{head}{r['mode']} | | error: {r['error'][:80]} | | |")
            continue
        m = r["memory"]
        lines.append(
            f"{head}{r['mode']} | {','.join(r['chosen'])} | {m['peak'] / 2**30:.2f} | "
            f"{m['temp'] / 2**30:.2f} | {m['temp'] / r['pair_bytes']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def _rows_table(results: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        f"# Rows over {results['config']['rows']['devices']} devices (deviceless compiles; no "
        "time measured)",
        "",
        "Peak: arguments + outputs + temporaries on one device of the mesh. Ideal: the same module "
        "and variant compiled for one device, its peak divided by the device count. Largest "
        "gather: the largest all-gather's result against the MSA or the pair (whichever is larger).",
        "",
        "| target | module | variant | style | N_seq x N_res | dtype | mode | peak GiB / device "
        "| / ideal | largest gather / input | all-to-all |",
        "| --- | --- | --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        head = (
            f"| {r['target']} | {r['what']} | {r['variant']} | {r['style']} | "
            f"{r['n_seq']} x {r['n_res']} | {r['dtype']} | {r['mode']} |"
        )
        if "error" in r:
            lines.append(f"{head} {r['error'][:120]} | | | |")
            continue
        ratio = "" if r["over_ideal"] is None else f"{r['over_ideal']:.2f}"
        lines.append(
            f"{head} {r['memory']['peak'] / 2**30:.2f} | {ratio} | "
            f"{r['largest_gather_over_input']:.3f} | {r['all_to_all']} |"
        )
    return "\n".join(lines) + "\n"


def _keys_tables(results: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    ops = [r for r in rows if r["what"] == OP]
    devices = results["config"]["keys"]["devices"]
    title = f"Keys over {devices} devices" if ops else "Family modules on a 2D grid"
    lines = [f"# {title} (deviceless compiles; no time measured)"]
    if ops:
        lines += [
            "",
            "Peak: arguments + outputs + temporaries on one device of the mesh. Ideal: the same call "
            "compiled for one device, its peak divided by the device count. Allowance (the goal): "
            "1.3x ideal plus one K/V shard in flight. Largest gather: the largest all-gather's result "
            "in K shards (a device's own block of K).",
            "",
            "| target | variant | tokens | dtype | mode | mask | peak MiB / device | / ideal | "
            "allowance MiB | largest gather (K shards) | collective-permutes |",
            "| --- | --- | ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
        ]
    for r in ops:
        head = (
            f"| {r['target']} | {r['variant']} | {r['n_res']} | {r['dtype']} | {r['mode']} | "
            f"{'causal' if r['is_causal'] else 'full'} |"
        )
        if "error" in r:
            lines.append(f"{head} {r['error'][:120]} | | | | |")
            continue
        lines.append(
            f"{head} {r['memory']['peak'] / 2**20:.1f} | {r['over_ideal']:.2f} | "
            f"{r['allowance'] / 2**20:.1f} | {r['largest_gather_over_k_shard']:.2f} | "
            f"{r['permutes']} |"
        )
    grid = [r for r in rows if r["what"] != OP]
    if grid:
        lines += [
            "",
            "## Family modules with their input tiled over a 2D grid (rows x columns)",
            "",
            "Share: the device's tile of the pair [N, N, 128] (TriangleAttention) or of the extra "
            "MSA [S, N, 64] (MSA column global attention, S rows). Largest gather: the largest "
            "all-gather's result in shares (the bias [h, N, N / columns] is gathered over the rows).",
            "",
            "| target | grid | variant | module | N_res | dtype | mode | peak GiB / device | "
            "/ share | share GiB | largest gather (shares) | fits |",
            "| --- | --- | --- | --- | ---: | --- | --- | ---: | ---: | ---: | ---: | --- |",
        ]
        for r in grid:
            head = (
                f"| {r['target']} | {r['mesh'][0]} x {r['mesh'][1]} | {r['variant']} | "
                f"{_module(r)} | {r['n_res']} | {r['dtype']} | {r['mode']} |"
            )
            if "error" in r:
                lines.append(f"{head} {r['error'][:120]} | | | | |")
                continue
            lines.append(
                f"{head} {r['memory']['peak'] / 2**30:.2f} | {r['over_share']:.2f} | "
                f"{r['pair_share'] / 2**30:.3f} | {r['largest_gather'] / r['pair_share']:.2f} | "
                f"{'yes' if r['fits'] else 'no'} |"
            )
        lines += ["", "Longest crop run that fits the device's memory:", ""]
        lines += [
            f"- {b['target']} {b['what']} ({b['variant']}) {b['mode']}: N_res {b['n_res']}"
            for b in longest_fitting(grid)
        ]
    return "\n".join(lines) + "\n"


def _module(row) -> str:
    """A grid row's module, with the extra MSA's rows where it has them."""
    return f"{row['what']} (S {row['n_seq']:,})" if row["n_seq"] > 1 else row["what"]


TABLES = dict(one_device=_one_device_tables, rows=_rows_table, keys=_keys_tables)
