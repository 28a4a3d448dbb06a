"""What jax.nn's arguments cost in the op (configs/benchmark.py's options preset).

Causal self-attention: the forward time with is_causal=True against the same call without it, per
implementation, in one fresh process under one malloc policy, variants interleaved round by round;
the ratio is the median of the per-round ratios. The full (non-causal) call is also timed alone in
another fresh process, as the baseline check.

Grouped-query attention: memory of N query heads over one key/value head, against one query head
over one key/value head (and N over N, what repeating K and V would cost): XLA's temp bytes and
the resident memory of a call in a fresh process (measure.resident_memory), forward and a training
step (the output's cotangent an argument).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from gated_attention_tools import child, measure

CAUSAL = ("full", "causal")


def _qkv(batch: int, length: int, heads: int, kv_heads: int, head_dim: int, dtype: str):
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (batch, length, heads, head_dim), dtype)
    k, v = (jax.random.normal(x, (batch, length, kv_heads, head_dim), dtype) for x in keys[1:])
    return q, k, v


def causal_cell(
    length: int,
    heads: int,
    head_dim: int,
    dtype: str,
    implementations: list[str],
    rounds: int,
    steps: int,
    variants: list[str] | None = None,
) -> list[dict[str, Any]]:
    """The child: every (implementation, causal or full) variant compiled, then timed in
    interleaved rounds; one row per variant (time_ms the median over rounds of each round's median
    of `steps` calls) with its per-round ratio to the full call of the same implementation.
    variants: names 'impl/full' or 'impl/causal' to time (default all)."""
    import gated_attention as ga

    q, k, v = jax.block_until_ready(_qkv(1, length, heads, heads, head_dim, dtype))
    fns = {}
    for impl in implementations:
        for kind in CAUSAL:
            name = f"{impl}/{kind}"
            if variants is None or name in variants:
                fns[name] = jax.jit(
                    lambda q, k, v, impl=impl, causal=kind == "causal": ga.dot_product_attention(
                        q, k, v, implementation=impl, is_causal=causal
                    )
                )
    for name, fn in fns.items():
        measure.time_calls(fn, (q, k, v), 1)  # compiles
        print(f"  compiled {name}", flush=True)
    per_round = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            seconds, _ = measure.time_calls(fn, (q, k, v), steps)
            per_round[name].append(statistics.median(seconds) * 1e3)
    rows = []
    for name, times in per_round.items():
        impl, kind = name.split("/")
        full = per_round.get(f"{impl}/full")
        ratios = [t / f for t, f in zip(times, full, strict=True)] if full else []
        rows.append(
            dict(
                implementation=impl,
                variant=kind,
                length=length,
                heads=heads,
                head_dim=head_dim,
                dtype=dtype,
                time_ms=statistics.median(times),
                round_ms=times,
                ratio_to_full=statistics.median(ratios) if ratios else None,
                ratio_range=[min(ratios), max(ratios)] if ratios else None,
            )
        )
    return rows


def gqa_problem(
    heads: int,
    kv_heads: int,
    length: int,
    head_dim: int,
    dtype: str,
    implementation: str,
    mode: str,
) -> tuple[Callable, tuple]:
    """The op with `heads` query heads over `kv_heads` key/value heads, as (fn, specs) for
    measure.resident_memory: the forward, or forward and backward with the cotangent an argument."""
    import gated_attention as ga

    q = jax.ShapeDtypeStruct((1, length, heads, head_dim), jnp.dtype(dtype))
    kv = jax.ShapeDtypeStruct((1, length, kv_heads, head_dim), jnp.dtype(dtype))

    def forward(q, k, v):
        return ga.dot_product_attention(q, k, v, implementation=implementation)

    if mode == "forward":
        return forward, (q, kv, kv)

    def step(q, k, v, cotangent):
        out, vjp = jax.vjp(forward, q, k, v)
        return vjp(cotangent)

    return step, (q, kv, kv, q)


def gqa_cell(**kwargs) -> dict[str, Any]:
    """XLA's temp bytes (compiled here) and the resident memory (a fresh process) of one case."""
    fn, specs = gqa_problem(**kwargs)
    xla = measure.xla_memory(jax.jit(fn), specs)
    resident = measure.resident_memory(f"{__name__}:gqa_problem", kwargs)
    return kwargs | dict(
        temp_mib=xla["temp_size_in_bytes"] / 2**20,
        resident_mib=resident["resident_mib"],
    )


def gqa_goal(
    cells: list[dict[str, Any]], heads: int, slack_mib: float = 0.0
) -> list[dict[str, Any]]:
    """Per implementation and mode: GQA's memory (N query heads over one key/value head; the larger
    of temp and resident) against the one-head case plus what the N query heads take themselves,
    measured as multi-head attention with N key/value heads, which needs no copy of K or V (so
    the bound is that case's memory). A GQA program that repeated K and V to N heads would take
    the copies on top. `slack_mib` is added to the bound (the smoke preset's: at its tiny shapes
    the memory is the allocator's noise)."""
    out = []
    for c in cells:
        if (c["heads"], c["kv_heads"]) != (heads, 1):
            continue

        def memory(n, kv, c=c):
            o = next(
                o
                for o in cells
                if (o["heads"], o["kv_heads"]) == (n, kv)
                and (o["implementation"], o["mode"], o["dtype"])
                == (c["implementation"], c["mode"], c["dtype"])
            )
            return max(o["temp_mib"], o["resident_mib"] or 0)

        one, multi = memory(1, 1), memory(heads, heads)
        judged = memory(heads, 1)
        out.append(
            dict(
                implementation=c["implementation"],
                mode=c["mode"],
                dtype=c["dtype"],
                gqa_mib=judged,
                one_head_mib=one,
                allowed_mib=one + (multi - one) + slack_mib,
                met=judged <= multi + slack_mib,
            )
        )
    return out


def run(cfg, log: Callable[[str], None] = print) -> dict[str, Any]:
    """configs/benchmark.py's options preset."""
    length, heads, head_dim = cfg.causal_shape
    causal = []
    for dtype in cfg.dtypes:
        log(f"causal: 1 x {length}, {heads} heads of {head_dim}, {dtype}")
        kwargs = dict(
            length=length,
            heads=heads,
            head_dim=head_dim,
            dtype=dtype,
            implementations=list(cfg.implementations),
            rounds=cfg.rounds,
            steps=cfg.steps,
        )
        rows = child.call(f"{__name__}:causal_cell", kwargs, log, allocator=cfg.allocator)
        goal_full = f"{cfg.goal_implementation}/full"
        log(f"  {goal_full} alone")
        alone = child.call(
            f"{__name__}:causal_cell",
            kwargs | dict(implementations=[cfg.goal_implementation], variants=[goal_full]),
            log,
            allocator=cfg.allocator,
        )[0]["time_ms"]
        for r in rows:
            if (r["implementation"], r["variant"]) == (cfg.goal_implementation, "full"):
                r |= dict(
                    alone_ms=alone,
                    harness_over_alone=r["time_ms"] / alone,
                    baseline_ok=abs(r["time_ms"] / alone - 1) <= cfg.baseline_tolerance,
                )
        causal += rows
    gqa = []
    length, heads, head_dim = cfg.gqa_shape
    for impl in cfg.gqa_implementations:
        for mode in cfg.modes:
            for dtype in cfg.dtypes:
                for n, kv in ((heads, 1), (1, 1), (heads, heads)):
                    log(f"gqa: {n} query heads over {kv}, {impl} {mode} {dtype}")
                    gqa.append(
                        gqa_cell(
                            heads=n,
                            kv_heads=kv,
                            length=length,
                            head_dim=head_dim,
                            dtype=dtype,
                            implementation=impl,
                            mode=mode,
                        )
                    )
    goals = [
        dict(
            goal="causal / full forward",
            implementation=r["implementation"],
            dtype=r["dtype"],
            figure=r["ratio_to_full"],
            allowed=cfg.causal_goal,
            met=r["ratio_to_full"] <= cfg.causal_goal,
        )
        for r in causal
        if r["variant"] == "causal" and r["implementation"] == cfg.goal_implementation
    ]
    goals += [
        dict(
            goal=f"GQA {heads}/1 memory (MiB) vs 1/1 + the query heads' own ({g['mode']})",
            implementation=g["implementation"],
            dtype=g["dtype"],
            figure=g["gqa_mib"],
            allowed=g["allowed_mib"],
            met=g["met"],
        )
        for g in gqa_goal(gqa, heads, cfg.gqa_slack_mib)
        if g["implementation"] == cfg.goal_implementation
    ]
    return dict(
        jax=jax.__version__,
        allocator=dict(policy=cfg.allocator, env=measure.allocator_env(cfg.allocator)),
        causal=causal,
        gqa=gqa,
        goals=goals,
    )


def markdown(results: dict[str, Any]) -> str:
    """The goals, the causal times and the GQA memory as Markdown tables."""
    env = " ".join(f"{k}={v}" for k, v in results["allocator"]["env"].items()) or "glibc's defaults"
    lines = [
        f"jax {results['jax']}; allocator policy '{results['allocator']['policy']}' ({env}).",
        "",
        "| goal | implementation | dtype | figure | at most | met |",
        "| --- | --- | --- | ---: | ---: | --- |",
    ]
    for g in results["goals"]:
        lines.append(
            f"| {g['goal']} | {g['implementation']} | {g['dtype']} | {g['figure']:.3f} "
            f"| {g['allowed']:.3f} | {'yes' if g['met'] else 'no'} |"
        )
    lines += [
        "",
        "| causal cell | implementation | variant | dtype | ms (median) | / full (rounds) "
        "| full alone ms, harness / alone |",
        "| --- | --- | --- | --- | ---: | ---: | --- |",
    ]
    for r in results["causal"]:
        ratio = (
            f"{r['ratio_to_full']:.3f} ({r['ratio_range'][0]:.3f}-{r['ratio_range'][1]:.3f})"
            if r["variant"] == "causal"
            else ""
        )
        alone = ""
        if "alone_ms" in r:
            flag = "" if r["baseline_ok"] else " FLAGGED"
            alone = f"{measure.figure(r['alone_ms'])}, {r['harness_over_alone']:.2f}{flag}"
        lines.append(
            f"| 1 x {r['length']}, {r['heads']} x {r['head_dim']} | {r['implementation']} "
            f"| {r['variant']} | {r['dtype']} | {measure.figure(r['time_ms'])} | {ratio} | {alone} |"
        )
    lines += [
        "",
        "| GQA cell (1 x T) | query heads / kv heads | implementation | mode | dtype "
        "| XLA temp MiB | resident MiB |",
        "| --- | --- | --- | --- | --- | ---: | ---: |",
    ]
    for c in results["gqa"]:
        resident = "n/a" if c["resident_mib"] is None else f"{c['resident_mib']:.1f}"
        lines.append(
            f"| {c['length']} x {c['head_dim']} | {c['heads']} / {c['kv_heads']} "
            f"| {c['implementation']} | {c['mode']} | {c['dtype']} | {c['temp_mib']:.1f} "
            f"| {resident} |"
        )
    return "\n".join(lines) + "\n"
