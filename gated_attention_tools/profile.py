"""Where a family cell's time goes: each XLA op's time from a jax.profiler trace, grouped by kind.

  python -m gated_attention_tools.profile --what=msa_column --n_seq=128 --n_res=256 \
      --mode=inference

builds the family benchmark's cell (AF2's module and ours, the same parameters and inputs), runs
each variant `--calls` times under jax.profiler, maps every traced op to its instruction in the
compiled HLO, and sums the op times per call by kind: projections (dots without a batch of heads:
q, k, v, gate, output and, in training, their weight gradients), the attention core (logits,
softmax, weighted sum and their gradients), LayerNorm, copies (transposes, broadcasts, slices)
and the rest. Run it under the steady allocator (docs/benchmarks.md), as the benchmarks do.

XLA:CPU runs some ops side by side, so a variant's op times can add up to more than its wall
time: read them as shares. Every Haiku module call runs inside jax.named_scope(its name), so an
op's metadata names its module (how LayerNorm is found); ops with no metadata (XLA:CPU's fused
dots of the attention core) are placed by their output's rank.
"""

from __future__ import annotations

import collections
import pathlib
import re
import tempfile
import time
from collections.abc import Callable

import haiku as hk
import jax
from absl import app, flags

from gated_attention_tools import family_benchmark

KINDS = ("projection", "attention", "layernorm", "copy", "other")
_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([\w\-]+)\(")
_ARRAY = re.compile(r"\w+\[([\d,]*)\]")
_CONTROL = ("while", "conditional", "call")  # their bodies' ops are traced on their own
_COPIES = re.compile(r"transpose|broadcast|copy|dynamic_slice|dynamic_update_slice|concatenate|pad")
_ATTENTION = re.compile(r"reduce_sum|exp|select_n|sub|div|mul|max")  # max: reduce_max too


def hlo_instructions(hlo_text: str) -> dict[str, tuple[str, int]]:
    """{instruction name: (its op_name metadata, the largest rank among its outputs)} of compiled
    HLO text; loops, conditionals and calls are left out (the ops of their bodies are traced)."""
    ops = {}
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        if m and m.group(3) not in _CONTROL:
            meta = re.search(r'op_name="([^"]*)"', line)
            ranks = [len(d.split(",")) if d else 0 for d in _ARRAY.findall(m.group(2))]
            ops[m.group(1)] = (meta.group(1) if meta else "", max(ranks, default=0))
    return ops


def kind(instruction: str, op_name: str, rank: int) -> str:
    """One of KINDS for an HLO instruction, from its op_name metadata and output rank."""
    last = op_name.rsplit("/", 1)[-1]
    is_dot = instruction.startswith("dot") or last.endswith("dot_general")
    if not op_name:  # XLA:CPU's YNN fusions of the attention core's dots carry no metadata
        return "attention" if instruction.startswith("ynn_fusion") and rank >= 3 else "other"
    if "norm" in op_name or "_var" in op_name:
        return "layernorm"
    if is_dot:
        return "projection" if rank <= 2 else "attention"
    if rank >= 4 and _ATTENTION.search(last):
        return "attention"
    if _COPIES.search(last):
        return "copy"
    return "other"


def op_times(fn: Callable, args: tuple, calls: int) -> collections.Counter:
    """{instruction name: ms per call} of the compiled fn(*args), from a jax.profiler trace of
    `calls` calls (fn is called once first, untraced)."""
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(calls):
                jax.block_until_ready(fn(*args))
        (path,) = pathlib.Path(d).rglob("*.xplane.pb")
        data = jax.profiler.ProfileData.from_file(str(path))
    times = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            for event in line.events:
                times[event.name] += event.duration_ns / 1e6 / calls
    return times


def _module_scopes(fn: Callable) -> Callable:
    """fn with every Haiku module call inside jax.named_scope(the module's name)."""

    def interceptor(method, args, kwargs, context):
        name = getattr(context.module, "module_name", None)  # None while __init__ runs
        if name is None:
            return method(*args, **kwargs)
        with jax.named_scope(name.rsplit("/", 1)[-1]):
            return method(*args, **kwargs)

    def scoped(*args):
        with hk.intercept_methods(interceptor):
            return fn(*args)

    return scoped


def profile_cell(cell: family_benchmark.Cell, calls: int = 3, variants=("af2", "ours")) -> dict:
    """{variant: {'wall_ms': mean wall time per call, untraced, 'kinds': {kind: ms per call}}}
    for a family module or block cell (not the whole model)."""
    step_fns, args = family_benchmark.cell_problem(cell, variants)
    result = {}
    for v, step in step_fns.items():
        fn = jax.jit(_module_scopes(step))
        ops = hlo_instructions(fn.lower(*args).compile().as_text())
        times = op_times(fn, args, calls)
        start = time.perf_counter()
        for _ in range(calls):
            jax.block_until_ready(fn(*args))
        kinds = dict.fromkeys(KINDS, 0.0)
        for name, ms in times.items():
            if name in ops:
                kinds[kind(name, *ops[name])] += ms
        wall = (time.perf_counter() - start) / calls * 1e3
        result[v] = dict(wall_ms=wall, kinds=kinds)
    return result


def markdown(cell: family_benchmark.Cell, result: dict) -> str:
    """The profile as a table: a row per variant, ms per call."""
    head = f"| {cell.name} {cell.mode} | wall | " + " | ".join(KINDS) + " |"
    lines = [head, "| --- |" + " ---: |" * (len(KINDS) + 1)]
    for v, r in result.items():
        cells = " | ".join(f"{r['kinds'][k]:.1f}" for k in KINDS)
        lines.append(f"| {v} | {r['wall_ms']:.1f} | {cells} |")
    return "\n".join(lines)


_WHAT = flags.DEFINE_enum("what", "msa_row", [*family_benchmark.MODULES, "evoformer"], "cell")
_N_SEQ = flags.DEFINE_integer("n_seq", 128, "MSA rows (ignored by the triangle modules)")
_N_RES = flags.DEFINE_integer("n_res", 256, "residues")
_MODE = flags.DEFINE_enum("mode", "inference", family_benchmark.MODES, "inference or training")
_CALLS = flags.DEFINE_integer("calls", 3, "traced calls per variant")


def main(argv):
    del argv
    cell = family_benchmark.Cell(_WHAT.value, _N_SEQ.value, _N_RES.value, "float32", _MODE.value)
    print(markdown(cell, profile_cell(cell, _CALLS.value)))


if __name__ == "__main__":
    app.run(main)
