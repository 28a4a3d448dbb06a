"""Past one device, compiled deviceless: AF2's attention family with the rows (the MSA's sequences,
the pair's first residue axis) split over a mesh of GPUs or TPU chips, per-device memory and the
collectives of each compiled program, against one device's peak divided by the device count (the
ideal). Nothing runs.

A cell is a module x mode x crop x dtype x variant x style: 'ours' with global_config.
shard_rows_over naming the mesh's axis (each device computes its own rows), or 'af2' (AF2's module
as installed, left to XLA's partitioner), under mesh axes of type Auto (jax.jit with sharded
inputs: how most users shard, and the only way AF2's own code can be) or Explicit. The parameters
are replicated, the activations, masks and the update's cotangent split along their rows.

  python scripts/benchmark.py --config=configs/benchmark.py:mesh_memory   # 8 H100s and a v5p slice
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable
from typing import Any

from gated_attention_tools import device_memory, family_benchmark, targets

STYLES = ("auto", "explicit")
AXIS = "rows"


@dataclasses.dataclass(frozen=True)
class Cell:
    target: str
    devices: int
    what: str
    variant: str  # 'ours' or 'af2'
    style: str  # 'auto' or 'explicit'
    n_seq: int
    n_res: int
    dtype: str
    mode: str
    memory_budget_mib: float | None = None  # ours' global_config.memory_budget_mib (None: default)


def compile_cell(**fields) -> dict[str, Any]:
    """The child: one cell compiled for its mesh; per-device memory, collectives, or the error."""
    import jax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    cell = Cell(**fields)
    axis_type = AxisType.Auto if cell.style == "auto" else AxisType.Explicit
    mesh = targets.mesh(cell.target, (cell.devices,), (AXIS,), axis_type)
    rows = AXIS if cell.variant == "ours" else None
    fn, specs = family_benchmark.memory_problem(
        cell.what, cell.variant, cell.n_seq, cell.n_res, cell.dtype, cell.mode,
        shard_rows_over=rows, memory_budget_mib=cell.memory_budget_mib,
    )  # fmt: skip
    inputs = len(specs) - (5 if cell.mode == "training" else 4)  # the parameters come first

    def place(i, spec):
        split = i >= inputs and spec.shape[0] % cell.devices == 0
        sharding = NamedSharding(mesh, P(AXIS) if split else P())
        return jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=sharding)

    placed = [place(i, s) for i, s in enumerate(specs)]
    input_bytes = max(math.prod(s.shape) * s.dtype.itemsize for s in specs[inputs:])
    # The outputs split as the inputs of their shape (the update, the activations' gradients; a
    # gradient of zeros for an input the module does not read too), the parameters' replicated:
    # left to XLA under Auto axes, such zeros come out whole on every device.
    split = {tuple(s.shape) for s in specs[inputs:] if s.shape[0] % cell.devices == 0}
    start = time.perf_counter()
    try:
        with jax.set_mesh(mesh):
            out_shardings = jax.tree.map(
                lambda o: NamedSharding(mesh, P(AXIS) if tuple(o.shape) in split else P()),
                jax.eval_shape(fn, *placed),
            )
            compiled = jax.jit(fn, out_shardings=out_shardings).lower(*placed).compile()
    except Exception as e:  # AF2's einsums under explicit axes, say: reported, not fatal
        return dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
    return dict(
        input_bytes=input_bytes,
        memory=targets.memory(compiled),
        collectives=targets.collectives(compiled),
        compile_s=round(time.perf_counter() - start, 1),
    )


def _one_device(cell: Cell, log) -> dict[str, Any]:
    """The same module, variant ('ours' unsharded) and crop compiled for one device."""
    fields = dict(
        target=cell.target, what=cell.what, variant=cell.variant, n_res=cell.n_res,
        n_seq=cell.n_seq, dtype=cell.dtype, mode=cell.mode,
    )  # fmt: skip
    try:
        return targets.in_child(f"{device_memory.__name__}:compile_cell", fields, log)
    except RuntimeError as e:
        return dict(error=str(e).splitlines()[-1][:300])


def summarize(row: dict[str, Any], one: dict[str, Any]) -> dict[str, Any]:
    """A row's peak per device over the ideal (one device's peak / devices), and what it gathers:
    the largest all-gather against the largest input (the MSA or the pair, whole)."""
    if "error" in row:
        return row
    ideal = one["memory"]["peak"] / row["devices"] if "memory" in one else None
    largest = targets.largest_gather(row["collectives"])
    return row | dict(
        over_ideal=None if ideal is None else row["memory"]["peak"] / ideal,
        one_device_peak=one.get("memory", {}).get("peak"),
        largest_gather_over_input=largest / row["input_bytes"],
        all_to_all=len(row["collectives"]["all-to-all"]),
    )


def run(cfg, log: Callable[[str], None] = print) -> dict[str, Any]:
    rows = []
    for target, what, dtype, mode in itertools.product(
        cfg.targets, cfg.whats, cfg.dtypes, cfg.modes
    ):
        n_seq, n_res = dict(cfg.crops)[what]
        base = Cell(
            target, cfg.devices, what, "ours", "auto", n_seq, n_res, dtype, mode,
            cfg.memory_budget_mib,
        )  # fmt: skip
        ones = {v: _one_device(dataclasses.replace(base, variant=v), log) for v in cfg.variants}
        for variant, style in itertools.product(cfg.variants, cfg.styles):
            cell = dataclasses.replace(base, variant=variant, style=style)
            got = targets.in_child(f"{__name__}:compile_cell", dataclasses.asdict(cell), log)
            row = summarize(dataclasses.asdict(cell) | got, ones[variant])
            rows.append(row)
            log(_line(row))
    return dict(suite="mesh_memory", rows=rows, devices=cfg.devices)


def _line(r: dict[str, Any]) -> str:
    head = f"{r['target']} x{r['devices']} {r['what']} {r['variant']} {r['style']} {r['n_seq']}x{r['n_res']} {r['dtype']} {r['mode']}"
    if "error" in r:
        return f"{head}: {r['error']}"
    ratio = "" if r["over_ideal"] is None else f", {r['over_ideal']:.2f}x ideal"
    return (
        f"{head}: peak {r['memory']['peak'] / 2**30:.2f} GiB a device{ratio}; largest gather "
        f"{r['largest_gather_over_input']:.3f} of the input; {r['all_to_all']} all-to-all"
    )


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"# Rows over {results['devices']} devices (deviceless compiles; no time measured)",
        "",
        "Peak: arguments + outputs + temporaries on one device of the mesh. Ideal: the same module "
        "and variant compiled for one device, its peak divided by the device count. Largest "
        "gather: the largest all-gather's result against the MSA or the pair (whichever is larger).",
        "",
        "| target | module | variant | style | N_seq x N_res | dtype | mode | peak GiB / device "
        "| / ideal | largest gather / input | all-to-all |",
        "| --- | --- | --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in results["rows"]:
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
