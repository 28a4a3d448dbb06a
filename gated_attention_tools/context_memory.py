"""Keys over devices, compiled deviceless: dot_product_attention with the query and key positions
split over a mesh axis (context parallelism), per-device memory and collectives against one
device's peak divided by the device count (the ideal). Nothing runs.

Variants: 'ring' (shard_keys_over names the axis: key blocks passed around the devices, merged by
log-sum-exp) and 'plain' (the same sharded inputs under jax.jit, left to XLA's partitioner: what
the op did before the ring). The training step takes the output's cotangent as an argument.

Grid cells: TriangleAttention (model_1's config) with the pair [N, N, 128] tiled over a 2D mesh
(global_config.shard_rows_over x shard_columns_over), each orientation attending along its split
axis by the ring, against the goals' figures: the device's share of the pair and a fixed budget.

  python scripts/benchmark.py --config=configs/benchmark.py:context_memory
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable
from typing import Any

from gated_attention_tools import targets

AXIS = "keys"


@dataclasses.dataclass(frozen=True)
class Cell:
    target: str
    devices: int  # 1: the one-device program (the ideal's numerator)
    variant: str  # 'ring' or 'plain'
    tokens: int
    heads: int
    head_dim: int
    dtype: str
    mode: str  # 'training' or 'inference'
    is_causal: bool
    key_bias: bool  # a [B, 1, 1, S] bias (keys only: it travels with them)


def problem(cell: Cell):
    """(fn, abstract args, the dimension each arg splits along): the op's call or training step."""
    import jax
    import jax.numpy as jnp

    import gated_attention as ga

    dtype = jnp.dtype(cell.dtype)
    qkv = jax.ShapeDtypeStruct((1, cell.tokens, cell.heads, cell.head_dim), dtype)
    bias = jax.ShapeDtypeStruct((1, 1, 1, cell.tokens), dtype)
    ring = AXIS if cell.variant == "ring" and cell.devices > 1 else None

    def attend(q, k, v, *bias):
        return ga.dot_product_attention(
            q, k, v, bias[0] if bias else None, is_causal=cell.is_causal, shard_keys_over=ring
        )

    args, dims = [qkv, qkv, qkv], [1, 1, 1]
    if cell.key_bias:
        args, dims = [*args, bias], [*dims, 3]
    if cell.mode == "inference":
        return attend, args, dims

    def step(*args):
        out, vjp = jax.vjp(attend, *args[:-1])
        return out, vjp(args[-1])

    return step, [*args, qkv], [*dims, 1]


def compile_cell(**fields) -> dict[str, Any]:
    """The child: one cell compiled for its mesh (or one device); memory, collectives or the error."""
    import jax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    cell = Cell(**fields)
    fn, args, dims = problem(cell)
    start = time.perf_counter()
    try:
        if cell.devices == 1:
            compiled = targets.compile(fn, *args, target=cell.target)
        else:
            mesh = targets.mesh(cell.target, (cell.devices,), (AXIS,), AxisType.Auto)
            split = lambda d: NamedSharding(mesh, P(*([None] * d), AXIS))
            placed = [
                jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=split(d))
                for a, d in zip(args, dims, strict=True)
            ]
            with jax.set_mesh(mesh):
                outs = jax.eval_shape(fn, *placed)
                out_shardings = jax.tree.map(
                    lambda o: split(1 if o.ndim == 4 and o.shape[1] == cell.tokens else 3), outs
                )
                compiled = jax.jit(fn, out_shardings=out_shardings).lower(*placed).compile()
    except Exception as e:  # reported, not fatal
        return dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
    return dict(
        kv_shard_bytes=2 * math.prod(args[1].shape) * args[1].dtype.itemsize // cell.devices,
        memory=targets.memory(compiled),
        collectives=targets.collectives(compiled),
        compile_s=round(time.perf_counter() - start, 1),
    )


def summarize(row: dict[str, Any], one: dict[str, Any]) -> dict[str, Any]:
    """Peak per device over the ideal, the goal's allowance (1.3x ideal + one K/V shard in
    flight), and the largest all-gather against one K shard."""
    if "error" in row or "memory" not in one:
        return row | ({} if "error" in row else dict(error=one.get("error", "no one-device peak")))
    ideal = one["memory"]["peak"] / row["devices"]
    largest = targets.largest_gather(row["collectives"])
    return row | dict(
        one_device_peak=one["memory"]["peak"],
        over_ideal=row["memory"]["peak"] / ideal,
        allowance=1.3 * ideal + row["kv_shard_bytes"],
        largest_gather_over_k_shard=largest / (row["kv_shard_bytes"] / 2),
        permutes=len(row["collectives"]["collective-permute"]),
    )


@dataclasses.dataclass(frozen=True)
class GridCell:
    target: str
    grid: tuple[int, int]  # (rows devices, columns devices)
    what: str  # 'triangle_start' or 'triangle_end'
    n_res: int
    dtype: str
    mode: str
    variant: str = "grid"  # 'grid': shard_rows_over x shard_columns_over; 'plain': left to XLA


def compile_grid_cell(**fields) -> dict[str, Any]:
    """The child: TriangleAttention on the tiled pair, compiled for the grid; memory,
    collectives and the device's share of the pair, or the error."""
    import haiku as hk
    import jax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import gated_attention as ga

    cell = GridCell(**{**fields, "grid": tuple(fields["grid"])})
    orientation = "per_row" if cell.what == "triangle_start" else "per_column"
    config = dict(num_head=4, orientation=orientation, dropout_rate=0.25)
    gc = dict(shard_rows_over="rows", shard_columns_over="cols") if cell.variant == "grid" else {}
    t = hk.transform(
        lambda pair, mask: ga.TriangleAttention(config, gc)(pair, mask, cell.mode == "training")
    )
    dtype = jax.numpy.dtype(cell.dtype)
    pair = jax.ShapeDtypeStruct((cell.n_res, cell.n_res, 128), dtype)
    mask = jax.ShapeDtypeStruct((cell.n_res, cell.n_res), dtype)
    params = jax.eval_shape(t.init, jax.random.PRNGKey(0), pair, mask)
    key = jax.random.PRNGKey(1)
    if cell.mode == "inference":
        fn, args = (lambda p, x, m: t.apply(p, key, x, m)), (params, pair, mask)
    else:

        def fn(p, x, m, cot):
            out, vjp = jax.vjp(lambda p, x: t.apply(p, key, x, m), p, x)
            return out, vjp(cot)

        args = (params, pair, mask, pair)
    mesh = targets.mesh(cell.target, cell.grid, ("rows", "cols"), AxisType.Auto)
    tile, whole = NamedSharding(mesh, P("rows", "cols")), NamedSharding(mesh, P())
    placed = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=whole), args[0])
    placed = (placed, *(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=tile) for a in args[1:]))
    start = time.perf_counter()
    try:
        with jax.set_mesh(mesh):
            shardings = jax.tree.map(
                lambda o: tile if o.shape[:2] == (cell.n_res,) * 2 else whole,
                jax.eval_shape(fn, *placed),
            )
            compiled = jax.jit(fn, out_shardings=shardings).lower(*placed).compile()
    except Exception as e:  # reported, not fatal
        return dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
    return dict(
        pair_share=math.prod(pair.shape) * dtype.itemsize // math.prod(cell.grid),
        memory=targets.memory(compiled),
        collectives=targets.collectives(compiled),
        compile_s=round(time.perf_counter() - start, 1),
    )


def _grid_line(r: dict[str, Any]) -> str:
    head = (
        f"{r['target']} {r['grid'][0]}x{r['grid'][1]} {r['variant']} {r['what']} {r['n_res']} "
        f"{r['dtype']} {r['mode']}"
    )
    if "error" in r:
        return f"{head}: {r['error']}"
    largest = targets.largest_gather(r["collectives"])
    return (
        f"{head}: peak {r['memory']['peak'] / 2**30:.2f} GiB a device, "
        f"{r['memory']['peak'] / r['pair_share']:.2f}x its share of the pair "
        f"({r['pair_share'] / 2**30:.3f} GiB); largest gather {largest / r['pair_share']:.2f} shares"
    )


def run(cfg, log: Callable[[str], None] = print) -> dict[str, Any]:
    grid_rows = []
    plain = [("h100", *c) for c in cfg.grid_plain]  # the same pair left to XLA: the baseline
    grid = itertools.product(cfg.grid_targets, cfg.grid_whats, cfg.grid_crops)
    for target, what, (mode, n_res), *variant in [*grid, *plain]:
        cell = GridCell(target, tuple(cfg.grid), what, n_res, cfg.dtypes[0], mode, *variant)
        got = targets.in_child(f"{__name__}:compile_grid_cell", dataclasses.asdict(cell), log)
        row = dataclasses.asdict(cell) | got
        if "error" not in row:
            largest = targets.largest_gather(row["collectives"])
            row |= dict(
                over_share=row["memory"]["peak"] / row["pair_share"],
                largest_gather=largest,
                fits=row["memory"]["peak"] <= targets.target(target).memory_bytes,
            )
        grid_rows.append(row)
        log(_grid_line(row))
    rows = []
    for target, dtype, mode, causal in itertools.product(
        cfg.targets, cfg.dtypes, cfg.modes, cfg.causal
    ):
        base = Cell(
            target, 1, "ring", cfg.tokens, cfg.heads, cfg.head_dim, dtype, mode, causal,
            cfg.key_bias,
        )  # fmt: skip
        one = targets.in_child(f"{__name__}:compile_cell", dataclasses.asdict(base), log)
        for variant in cfg.variants:
            cell = dataclasses.replace(base, devices=cfg.devices, variant=variant)
            got = targets.in_child(f"{__name__}:compile_cell", dataclasses.asdict(cell), log)
            row = summarize(dataclasses.asdict(cell) | got, one)
            rows.append(row)
            log(_line(row))
    return dict(
        suite="context_memory",
        rows=rows,
        devices=cfg.devices,
        grid_rows=grid_rows,
        longest=longest_fitting(grid_rows),
    )


def longest_fitting(grid_rows) -> list[dict[str, Any]]:
    """Per target, module, variant and mode: the longest N_res run whose peak fits the device."""
    best = {}
    for r in grid_rows:
        if r.get("fits"):
            key = (r["target"], r["what"], r["variant"], r["mode"])
            best[key] = max(best.get(key, 0), r["n_res"])
    names = ("target", "what", "variant", "mode")
    return [dict(zip(names, k, strict=True), n_res=n) for k, n in best.items()]


def _head(r: dict[str, Any]) -> str:
    causal = "causal" if r["is_causal"] else "full"
    return (
        f"{r['target']} x{r['devices']} {r['variant']} {r['tokens']} tokens {r['dtype']} "
        f"{r['mode']} {causal}"
    )


def _line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{_head(r)}: {r['error']}"
    return (
        f"{_head(r)}: peak {r['memory']['peak'] / 2**20:.1f} MiB a device, "
        f"{r['over_ideal']:.2f}x ideal (allowance {r['allowance'] / 2**20:.1f} MiB); largest "
        f"gather {r['largest_gather_over_k_shard']:.2f} K shards; {r['permutes']} permutes"
    )


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"# Keys over {results['devices']} devices (deviceless compiles; no time measured)",
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
    for r in results["rows"]:
        causal = "causal" if r["is_causal"] else "full"
        head = (
            f"| {r['target']} | {r['variant']} | {r['tokens']} | {r['dtype']} | {r['mode']} | "
            f"{causal} |"
        )
        if "error" in r:
            lines.append(f"{head} {r['error'][:120]} | | | | |")
            continue
        lines.append(
            f"{head} {r['memory']['peak'] / 2**20:.1f} | {r['over_ideal']:.2f} | "
            f"{r['allowance'] / 2**20:.1f} | {r['largest_gather_over_k_shard']:.2f} | "
            f"{r['permutes']} |"
        )
    grid = results.get("grid_rows", [])
    if grid:
        lines += [
            "",
            "## TriangleAttention with the pair tiled over a 2D grid (rows x columns)",
            "",
            "Share: the device's tile of the pair [N, N, 128]. Largest gather: the largest "
            "all-gather's result in shares (the bias [h, N, N / columns] is gathered over the rows).",
            "",
            "| target | grid | variant | module | N_res | dtype | mode | peak GiB / device | "
            "/ share | share GiB | largest gather (shares) | fits |",
            "| --- | --- | --- | --- | ---: | --- | --- | ---: | ---: | ---: | ---: | --- |",
        ]
        for r in grid:
            head = (
                f"| {r['target']} | {r['grid'][0]} x {r['grid'][1]} | {r['variant']} | {r['what']} | "
                f"{r['n_res']} | "
                f"{r['dtype']} | {r['mode']} |"
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
            for b in results.get("longest", [])
        ]
    return "\n".join(lines) + "\n"
