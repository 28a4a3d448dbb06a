"""Measurements shared by run.py and the benchmarks: time, XLA's memory analysis (the one reader of
it: `compiled_memory`), FLOPs, CPU steal, and resident or device memory measured in a fresh process
(child.call runs the probes: `resident_memory` and `device_memory`).
"""

from __future__ import annotations

import gc
import importlib
import math
import os
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


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


def figure(value: float, digits: int = 3) -> str:
    """A measured number as people read it: `digits` significant figures, thousands separated
    (0.534, 12.3, 1,048); the JSON results keep the raw value."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    return f"{value:,.{decimals}f}"


def compiled_memory(compiled) -> dict[str, int] | None:
    """XLA's memory analysis of a compiled program, bytes: argument, output, temp, alias, and peak
    (arguments + outputs + temporaries - aliased: what must fit at once); None where the backend
    gives none. On CPU the temp bytes miss the scratch of fused kernels (see `resident_memory`)."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    read = lambda key: int(getattr(stats, f"{key}_size_in_bytes", 0) or 0)
    out = {key: read(key) for key in ("argument", "output", "temp", "alias")}
    return out | dict(peak=out["argument"] + out["output"] + out["temp"] - out["alias"])


def xla_memory(jitted: Callable, args: tuple) -> dict[str, int | None]:
    """compiled_memory of jitted(*args), compiled: temp, argument and output bytes, by XLA's names.

    Args may be arrays or jax.ShapeDtypeStructs (nothing is then allocated or run).
    """
    memory = compiled_memory(jitted.lower(*args).compile())
    keys = ("temp", "argument", "output")
    return {f"{key}_size_in_bytes": (None if memory is None else memory[key]) for key in keys}


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


# --------------------------------------------------------------------------------------------------
# Resident memory: what a call adds to the process's peak RSS, in a fresh process.

_RESIDENT_KEYS = ("resident_mib", "baseline_mib", "peak_mib", "output_mib")


# glibc malloc's tuning, one policy for every variant of a timed cell. XLA:CPU's large temp buffers
# come from mmap (fresh pages, faulted in and zeroed on every call) or from the heap, by a threshold
# that glibc moves with the process's history: the same program then runs at different speeds from one
# process to the next. 'steady' fixes the threshold above any buffer and never trims the heap, so
# a buffer's pages are reused from call to call, as a GPU/TPU's preallocated pool reuses them;
# 'default' leaves glibc's dynamic threshold, what a CPU user meets without tuning.
ALLOCATOR_POLICIES = {
    "steady": {"MALLOC_MMAP_THRESHOLD_": "4294967296", "MALLOC_TRIM_THRESHOLD_": "4294967296"},
    "default": {},
}


def allocator_env(policy: str) -> dict[str, str]:
    """The environment variables of an ALLOCATOR_POLICIES policy (ValueError for another name)."""
    if policy not in ALLOCATOR_POLICIES:
        raise ValueError(f"allocator must be one of {sorted(ALLOCATOR_POLICIES)}, got {policy!r}")
    return dict(ALLOCATOR_POLICIES[policy])


def check_baseline(
    rows: list[dict], alone_ms: float, tolerance: float, baseline: str = "af2"
) -> list[dict]:
    """A cell's rows with the baseline's (the variant `baseline`) time alone in a fresh process
    and the check that its time in the harness agrees with that within `tolerance` (a fraction):
    baseline_ok False flags the cell."""
    harness = next(r["time_ms"] for r in rows if r["variant"] == baseline)
    ratio = harness / alone_ms
    check = dict(
        af2_alone_ms=alone_ms,
        af2_harness_over_alone=ratio,
        baseline_ok=abs(ratio - 1) <= tolerance,
    )
    return [r | check for r in rows]


def alone_cell(row: dict, baseline: str = "af2") -> str:
    """A table cell: the baseline's time alone and the harness's ratio to it, on its row."""
    if row["variant"] != baseline or "af2_alone_ms" not in row:
        return ""
    flag = "" if row["baseline_ok"] else " FLAGGED"
    return f"{figure(row['af2_alone_ms'])}, {row['af2_harness_over_alone']:.2f}{flag}"


def allocator_line(allocator: dict, rows: list[dict], name_key: str) -> str:
    """A results line: the malloc policy and which cells' baseline check failed."""
    env = " ".join(f"{k}={v}" for k, v in allocator["env"].items()) or "glibc's defaults"
    flagged = sorted(
        {f"{r[name_key]} {r['dtype']} {r['mode']}" for r in rows if not r.get("baseline_ok", True)}
    )
    verdict = (
        f"FLAGGED (off by more than the tolerance): {', '.join(flagged)}."
        if flagged
        else "every cell within the tolerance."
    )
    return (
        f"Allocator policy '{allocator['policy']}' in every child ({env}). Baseline check, AF2's "
        f"time in the harness against AF2 alone in a fresh process (same policy): {verdict}"
    )


def child_env(allocator: str | None = None, **overrides: str) -> dict[str, str]:
    """The environment of a child process run with `python -m gated_attention_tools.<module>`:
    this process's, with its sys.path (and this package's root) as PYTHONPATH, and `overrides`.

    Args:
      allocator: None keeps this process's malloc variables; a policy name of
        ALLOCATOR_POLICIES replaces them (any MALLOC_* variable here is dropped first).
    """
    env = dict(os.environ)
    if allocator is not None:
        policy = allocator_env(allocator)
        env = {k: v for k, v in env.items() if not k.startswith("MALLOC_")} | policy
    return dict(
        env,
        PYTHONPATH=os.pathsep.join([str(pathlib.Path(__file__).parents[1]), *sys.path]),
        **overrides,
    )


def resident_memory(builder: str, kwargs: dict[str, Any], timeout_s: float = 1800) -> dict:
    """Peak resident memory of one call of a jitted function, measured in a fresh CPU process.

    The child (this module run with `python -m`, JAX_PLATFORMS=cpu) calls `builder(**kwargs)`,
    which returns (fn, specs) with specs a tuple of jax.ShapeDtypeStruct or None. It compiles
    jax.jit(fn) for specs, creates the inputs (ones) on the device, runs one warm-up call and frees
    its output, resets the peak RSS (writing 5 to /proc/self/clear_refs), reads VmRSS, runs the call
    once more and reads VmHWM: resident_mib = (VmHWM - VmRSS before the call - the output's bytes)
    / 2**20, at least 0.

    Args:
      builder: 'module:function', importable in the child (the parent's sys.path is passed on).
      kwargs: JSON-serializable keyword arguments of builder.
      timeout_s: how long the child may run.

    Returns:
      dict with resident_mib, baseline_mib, peak_mib, output_mib (None values off Linux), peak_reset
      (False: /proc/self/clear_refs could not be written, so the peak is VmHWM over the process's
      whole life, compilation included, an upper bound) and note.

    Raises:
      RuntimeError: the child failed or printed no result (its stderr's tail included).
    """
    if not sys.platform.startswith("linux"):
        return dict.fromkeys(_RESIDENT_KEYS) | dict(peak_reset=False, note="needs Linux's /proc")
    env = dict(
        JAX_PLATFORMS="cpu",
        # Buffers of 128 KiB and more are mapped on allocation and unmapped on free, so a call's
        # buffers are not served from memory that the warm-up call left in malloc's free lists.
        MALLOC_MMAP_THRESHOLD_="131072",
    )
    return _probe("resident-memory", "_resident_child", builder, kwargs, env, timeout_s)


def _probe(probe: str, function: str, builder, kwargs, env, timeout_s) -> dict[str, Any]:
    """function(builder, kwargs) of this module in a child process (child.call, this process's
    environment and `env`, its printed lines dropped); RuntimeError names the probe and builder."""
    from gated_attention_tools import child  # here: child.py imports this module (child_env)

    try:
        return child.call(
            f"{__name__}:{function}", dict(builder=builder, kwargs=kwargs), lambda line: None,
            timeout_s=timeout_s, env=env,
        )  # fmt: skip
    except RuntimeError as e:
        raise RuntimeError(f"{probe} probe of {builder}({kwargs}) failed: {e}") from None


def _proc_status_bytes() -> dict[str, int]:
    """VmRSS and VmHWM of this process in bytes, from /proc/self/status."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024  # reported in kB
    return out


def _built(builder: str, kwargs: dict[str, Any]):
    module, _, name = builder.partition(":")
    return getattr(importlib.import_module(module), name)(**kwargs)


def _resident_child(builder: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    fn, specs = _built(builder, kwargs)
    compiled = jax.jit(fn).lower(*specs).compile()
    inputs = jax.block_until_ready(
        tuple(None if s is None else jnp.ones(s.shape, s.dtype) for s in specs)
    )
    warm_up = jax.block_until_ready(compiled(*inputs))
    for x in jax.tree.leaves(warm_up):
        x.delete()  # now: dropping the last reference leaves it to the garbage collector
    del warm_up
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current VmRSS
        peak_reset, note = True, "peak RSS reset by /proc/self/clear_refs"
    except OSError as e:
        peak_reset = False
        note = f"/proc/self/clear_refs not writable ({e}): VmHWM is the process's lifetime peak"
    baseline = _proc_status_bytes()["VmRSS"]
    out = jax.block_until_ready(compiled(*inputs))
    peak = _proc_status_bytes()["VmHWM"]
    output = sum(x.nbytes for x in jax.tree.leaves(out))
    # At least 0: the output may land in pages the process already held.
    resident = max(0, peak - baseline - output)
    values = (resident, baseline, peak, output)
    return {key: v / 2**20 for key, v in zip(_RESIDENT_KEYS, values, strict=True)} | dict(
        peak_reset=peak_reset, note=note
    )


def call_peak(call: Callable[[], Any]) -> tuple[dict[str, Any], Any]:
    """What one call adds to the memory in use at its peak (its temporaries and outputs), measured
    in this process, and the call's output.

    On a device with memory_stats() (a GPU): peak_bytes_in_use, which never resets, so the figure
    is exact only when the call raises the process's peak; otherwise it is the old peak over the
    bytes in use before the call, an upper bound (exact False). Measure calls in rising order of
    their expected peak (and compile before) to keep them exact. On CPU: VmHWM after resetting it
    through /proc/self/clear_refs (exact unless the reset is refused).

    Returns:
      (dict(added_bytes, exact, how), output).
    """
    device = jax.devices()[0]
    stats = device.memory_stats() if jax.default_backend() != "cpu" else None
    if stats is not None:
        before, old_peak = stats["bytes_in_use"], stats["peak_bytes_in_use"]
        out = jax.block_until_ready(call())
        peak = device.memory_stats()["peak_bytes_in_use"]
        exact = peak > old_peak
        how = "device peak_bytes_in_use" + ("" if exact else " (an upper bound: an older peak)")
        return dict(added_bytes=max(peak, old_peak) - before, exact=exact, how=how), out
    if not sys.platform.startswith("linux"):
        return dict(added_bytes=None, exact=False, how="needs Linux's /proc"), call()
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current VmRSS
        exact = True
    except OSError:
        exact = False
    before = _proc_status_bytes()["VmRSS"]
    out = jax.block_until_ready(call())
    added = _proc_status_bytes()["VmHWM"] - before
    how = "resident memory (VmHWM)" + ("" if exact else ", peak not reset: an upper bound")
    return dict(added_bytes=max(0, added), exact=exact, how=how), out


# Device memory: what a call adds to the device's peak bytes in use, in a fresh process.


def device_memory(builder: str, kwargs: dict[str, Any], timeout_s: float = 1800) -> dict:
    """Peak device memory of one call of a jitted function, in a fresh process on the default
    backend (a GPU's memory_stats(); resident_memory's VmHWM where the device reports none, CPU).

    The child calls `builder(**kwargs)` -> (fn, specs) as for resident_memory, creates the inputs
    (ones), reads the device's bytes_in_use, compiles jax.jit(fn) and runs it once: peak_mib =
    (peak_bytes_in_use - bytes_in_use before - the output's bytes) / 2**20. The compilation's own
    scratch (autotuning) counts where it is the larger: the figure is then an upper bound.

    Returns:
      dict with peak_mib and note.
    """
    if jax.default_backend() == "cpu" or jax.devices()[0].memory_stats() is None:
        resident = resident_memory(builder, kwargs, timeout_s)
        return dict(
            peak_mib=resident["resident_mib"], note="resident memory (VmHWM): " + resident["note"]
        )
    return _probe("device-memory", "_device_child", builder, kwargs, None, timeout_s)


def _device_child(builder: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    fn, specs = _built(builder, kwargs)
    inputs = jax.block_until_ready(
        tuple(None if s is None else jnp.ones(s.shape, s.dtype) for s in specs)
    )
    device = jax.devices()[0]
    before = device.memory_stats()["bytes_in_use"]
    out = jax.block_until_ready(jax.jit(fn)(*inputs))
    peak = device.memory_stats()["peak_bytes_in_use"]
    output = sum(x.nbytes for x in jax.tree.leaves(out))
    return dict(
        peak_mib=max(0, peak - before - output) / 2**20,
        note="device peak_bytes_in_use over inputs and output (compilation included)",
    )
