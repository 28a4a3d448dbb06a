"""Keys over devices, compiled deviceless: dot_product_attention with the query and key positions
split over a mesh axis (context parallelism), per-device memory and collectives against one
device's peak divided by the device count (the ideal). Nothing runs.

Variants: 'ring' (shard_keys_over names the axis: key blocks passed around the devices, merged by
log-sum-exp) and 'plain' (the same sharded inputs under jax.jit, left to XLA's partitioner: what
the op did before the ring). The training step takes the output's cotangent as an argument.

  python scripts/benchmark.py --config=configs/benchmark.py:context_memory
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable
from typing import Any

from gated_attention_tools import mesh_memory, targets

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
    largest = max((mesh_memory._bytes(s) for s in row["collectives"]["all-gather"]), default=0)
    return row | dict(
        one_device_peak=one["memory"]["peak"],
        over_ideal=row["memory"]["peak"] / ideal,
        allowance=1.3 * ideal + row["kv_shard_bytes"],
        largest_gather_over_k_shard=largest / (row["kv_shard_bytes"] / 2),
        permutes=len(row["collectives"]["collective-permute"]),
    )


def run(cfg, log: Callable[[str], None] = print) -> dict[str, Any]:
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
    return dict(suite="context_memory", rows=rows, devices=cfg.devices)


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
    return "\n".join(lines) + "\n"
