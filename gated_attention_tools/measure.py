"""Measurements shared by run.py and benchmark.py: time, XLA temp bytes, FLOPs and CPU steal."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax


def time_calls(fn: Callable, args: tuple, calls: int) -> tuple[list[float], Any]:
    """Calls fn(*args) `calls` times, each until its output is ready.

    The first call of a fresh jax.jit function compiles it: time it apart (calls=1).

    Returns:
      (seconds of each call, the last call's output or None if calls == 0).
    """
    seconds, out = [], None
    for _ in range(calls):
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        seconds.append(time.perf_counter() - start)
    return seconds, out


def xla_memory(jitted: Callable, args: tuple) -> dict[str, int | None]:
    """XLA's compiled memory analysis of jitted(*args): temp, argument and output bytes.

    Args may be arrays or jax.ShapeDtypeStructs (nothing is then allocated or run). On CPU the temp
    bytes miss the scratch of fused kernels.
    """
    stats = jitted.lower(*args).compile().memory_analysis()
    keys = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes")
    return {key: (None if stats is None else int(getattr(stats, key))) for key in keys}


def attention_flops(
    *,
    batch: int,
    num_queries: int,
    num_keys: int,
    q_channels: int,
    m_channels: int,
    key_dim: int,
    value_dim: int,
    output_dim: int,
    num_head: int,
    gating: bool,
    pair_channels: int = 0,
    global_query: str | None = None,
) -> int:
    """Matmul FLOPs (2 per multiply-add) of one forward of gated attention over `batch` sequences.

    Counts the query/key/value projections, the gate, the two attention matmuls, the output
    projection and, with pair_channels, the pair-bias projection [q, k, pair_channels] ->
    [num_head, q, k]. key_dim and value_dim are totals over the heads.

    Args:
      global_query: None for Attention. 'mean' for AF2's MSAColumnGlobalAttention: one query per
        sequence (the masked mean) and one shared key/value head. 'per_position' for run.build's
        GlobalAttention: projections counted per position as Attention's (an overcount, kept so
        that reports stay comparable), attention matmuls for one query.
    """
    b, q, k, a, m = batch, num_queries, num_keys, q_channels, m_channels
    out = 2 * b * q * value_dim * output_dim + (2 * b * q * a * value_dim if gating else 0)
    if global_query == "mean":
        kv = 2 * b * k * m * (key_dim + value_dim) // num_head
        return kv + 2 * b * (a * key_dim + k * (key_dim + value_dim)) + out
    proj = 2 * b * (q * a * key_dim + k * m * (key_dim + value_dim))
    if global_query == "per_position":
        return proj + out + 2 * b * k * (key_dim + value_dim)
    if global_query is not None:
        raise ValueError(
            f"global_query must be None, 'mean' or 'per_position', got {global_query!r}"
        )
    core = 2 * b * q * k * (key_dim + value_dim)
    return proj + out + core + 2 * q * k * pair_channels * num_head


def cpu_ticks() -> tuple[int, int] | None:
    """(steal, total) CPU ticks of the whole machine since boot, from /proc/stat; None elsewhere.

    Steal is time the hypervisor gave this VM's virtual CPUs to someone else: on a shared host it
    is the visible part of the noise in the timings.
    """
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return ticks[7], sum(ticks)


def steal_percent(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """Percent of all CPU ticks between two cpu_ticks() readings that were stolen (None: unknown)."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return 100 * (after[0] - before[0]) / (after[1] - before[1])
