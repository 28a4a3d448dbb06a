"""The one sweep (issue 57): every tuning candidate the GPU takes (gated_attention/attention/
candidates.py: tiles, warps, stages and rows a program of the Triton kernel, keys a tile of the
Mosaic one, cuDNN, XLA) timed at AlphaFold 2's attention cells, forward and training step,
bfloat16 and float32, within a time budget; writes results.json, results.md and tuning.json, the
per-device table 'auto' reads (tuning_table.py: the fastest candidate per dtype, mode and shape
class, with its options).

  python scripts/device_check.py --tests= --preset=sweep --out=DIR --budget_s=290   # a GPU
  python scripts/benchmark.py --config=configs/benchmark.py:sweep_smoke   # CPU, interpreted

A cell is a shape x dtype x mode of the op (device_benchmark.OpShape, its inputs op_inputs: q, k,
v, a bias shared over the rows unless the shape has none, a key mask; op_step's training step, the
vjp of q, k, v and the bias at a cotangent passed in as an argument). Per shape and dtype, in one
process: every candidate's program of each mode and the float32 reference (our XLA implementation
at 'highest' precision on the same rounded inputs: jax.nn's dense XLA attention would hold 128 GiB
of logits at the triangle of 2,048) are lowered one after another, then compiled together in
cfg.compile_workers threads (XLA's compilers release the GIL; both modes at once keep the threads
busy past the longest compile); per cell each candidate is called once (its largest difference
from the reference over the outputs, relative to the reference's largest entry, `accurate` when
within cfg.tolerance of its dtype), then timed in cfg.rounds interleaved rounds of cfg.steps calls
(the time is the median over rounds; one call a round where the first took longer than
cfg.long_call_s). A candidate that does not build, compile or run on the
device is a row with the reason (`unavailable`), not a failure.

Budget: the cells run in priority order (bfloat16 first, AF2's dtype on a GPU; per shape the
training step, then the forward); no shape and dtype starts once cfg.time_budget_s has passed
since the start, and the cells left are rows 'not run: the time budget was spent'. The results name the GPU's compute
capability the candidates were chosen for (cfg.capability: '' the device's; the smoke preset
names an H100's, '9.0', and runs the kernels interpreted).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

import gated_attention as ga
from gated_attention.attention import candidates as tuning_candidates
from gated_attention.core import platforms
from gated_attention_tools import child, device_benchmark, measure, tuning_table

MODES = device_benchmark.MODES
DTYPES = ("bfloat16", "float32")
REFERENCE = "reference"  # the float32 reference's program among a cell's compiles
# The child's tagged lines: its environment first, then each group's rows as they are done, so
# that a child that dies (a kernel that crashes the GPU) leaves the groups before it (run()).
_HEAD, _ROWS = "sweep-head: ", "sweep-rows: "


def check_config(cfg) -> None:
    """ValueError for dtypes, modes, implementations or a capability the sweep does not know."""
    for name, values, allowed in (
        ("dtypes", cfg.dtypes, DTYPES),
        ("modes", cfg.modes, MODES),
        ("implementations", cfg.implementations, tuning_candidates.GPU),
    ):
        for value in values:
            if value not in allowed:
                raise ValueError(f"config.{name} entries must be in {allowed}, got {value!r}")
    capability(cfg.capability)
    if cfg.candidates_per_implementation < 0:
        raise ValueError(
            "config.candidates_per_implementation must be >= 0 (0: every candidate), got "
            f"{cfg.candidates_per_implementation}"
        )
    for dtype in cfg.dtypes:
        if dtype not in cfg.tolerance:
            raise ValueError(f"config.tolerance must name every dtype swept, got no {dtype!r}")


def capability(spec: str) -> tuple[int, int] | None:
    """'9.0' -> (9, 0); '' -> None (the device's)."""
    if not spec:
        return None
    try:
        major, minor = (int(x) for x in spec.split("."))
    except ValueError:
        raise ValueError(
            f"config.capability must be '' (the device's) or 'major.minor' such as '9.0', got "
            f"{spec!r}"
        ) from None
    return major, minor


def cells(cfg) -> list[device_benchmark.Cell]:
    """The cells in priority order: dtype, then shape, then mode."""
    shapes = [device_benchmark.OpShape(*s) for s in cfg.op_shapes]
    return [
        device_benchmark.Cell("op", s, d, m) for d in cfg.dtypes for s in shapes for m in cfg.modes
    ]


def skipped(candidate, skip) -> bool:
    """Whether cfg.skip names the candidate or one of its fields ('c2': every two-consumer one)."""
    name = candidate.name
    return any(x == name or x in name.partition(":")[2].split(",") for x in skip)


def backward_only(candidate) -> bool:
    """Whether the candidate sets a field of its implementation's BACKWARD_FIELDS."""
    impl = type(candidate.build())
    return any(value for field, value in candidate.options if field in impl.BACKWARD_FIELDS)


def cell_candidates(cell, cap, cfg) -> list[tuning_candidates.Candidate]:
    """The candidates a GPU of capability `cap` takes at the cell (its bias and mask form), of
    cfg.implementations, less those cfg.skip names (and in the forward those that only change
    the backward), the first cfg.candidates_per_implementation of each (0: all)."""
    s = cell.shape
    found = tuning_candidates.for_target(
        cap, cell.dtype, s.head_dim, bias="shared" if s.bias else "none",
        mask="key" if s.mask else "none", implementations=tuple(cfg.implementations),
    )  # fmt: skip
    found = [c for c in found if not skipped(c, cfg.get("skip", ()))]
    if cell.mode == "forward":  # a backward-only option's forward is its twin's
        found = [c for c in found if not backward_only(c)]
    if not cfg.candidates_per_implementation:
        return found
    kept, count = [], {}
    for c in found:
        count[c.implementation] = count.get(c.implementation, 0) + 1
        if count[c.implementation] <= cfg.candidates_per_implementation:
            kept.append(c)
    return kept


def _attend(impl):
    return lambda q, k, v, bias, mask: ga.dot_product_attention(
        q, k, v, bias, mask, implementation=impl, compute_dtype="input"
    )


def _worst(out, reference) -> float:
    worst, finite = device_benchmark._difference(out, reference)
    return float(worst) if bool(finite) else float("inf")


def groups(cfg) -> list[list[device_benchmark.Cell]]:
    """cells(cfg) in groups of one shape and dtype (its modes): a group's programs are compiled
    together, so the pool's threads stay busy past any one long compile."""
    out = []
    for cell in cells(cfg):
        if out and (out[-1][0].shape, out[-1][0].dtype) == (cell.shape, cell.dtype):
            out[-1].append(cell)
        else:
            out.append([cell])
    return out


def run_group(group, cfg, cap, log=print) -> list[dict[str, Any]]:
    """One row per candidate of each cell of the group (those that did not build or run with
    the reason): every program of the group lowered, then compiled at once in threads; each
    cell's candidates then checked and timed on that cell's inputs."""
    start = time.perf_counter()
    prepared, lowered = [], {}
    for cell in group:
        args = device_benchmark.op_inputs(cell.shape, cell.dtype, cell.mode)
        found = cell_candidates(cell, cap, cfg)
        rows = {c.name: _row(cell, c) for c in found}
        for c in found:
            try:
                impl = c.build(interpret=cfg.interpret_pallas)
                step = device_benchmark.op_step(_attend(impl), cell.mode)
                lowered[cell.mode, c.name] = jax.jit(step).lower(*args)
            except Exception as e:  # refused (NotImplementedError) or failed to lower
                rows[c.name]["unavailable"] = device_benchmark._reason(e)
        with jax.default_matmul_precision("highest"):
            step = device_benchmark.op_step(_attend(ga.XlaAttention()), cell.mode)
            lowered[cell.mode, REFERENCE] = jax.jit(step).lower(*_float32_specs(args))
        prepared.append((cell, args, rows))
    lower_s = time.perf_counter() - start
    compiled = device_benchmark._compile_all(lowered, cfg.compile_workers)
    log(
        f"  {group[0].shape.name} {group[0].dtype}: {len(lowered)} programs lowered in "
        f"{lower_s:.1f} s, compiled in {time.perf_counter() - start - lower_s:.1f} s"
    )
    out = []
    for cell, args, rows in prepared:
        mine = {name: exe for (mode, name), exe in compiled.items() if mode == cell.mode}
        out += _time_cell(cell, args, rows, mine, cfg, log)
    log(f"  {group[0].shape.name} {group[0].dtype}: {time.perf_counter() - start:.1f} s in all")
    return out


def _float32_specs(args):
    """The arguments' shapes with floating dtypes as float32: lowering allocates nothing."""
    spec = lambda x: jax.ShapeDtypeStruct(
        x.shape, jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
    )
    return jax.tree.map(spec, args)


def _row(cell, c) -> dict[str, Any]:
    return dict(
        level="op", shape=cell.shape.name, dtype=cell.dtype, mode=cell.mode,
        shape_dims=dataclasses.asdict(cell.shape), variant=c.name,
        implementation=c.implementation, options=c.as_dict(),
    )  # fmt: skip


def _time_cell(cell, args, rows, compiled, cfg, log) -> list[dict[str, Any]]:
    """The cell's rows with each compiled candidate's difference from the reference, checked
    against cfg.tolerance, and its time over interleaved rounds."""
    reference = compiled.pop(REFERENCE)
    try:
        if isinstance(reference, Exception):
            raise reference
        reference = jax.block_until_ready(reference(*device_benchmark._float32(args)))
    except Exception as e:  # the candidates are still timed, their accuracy not judged
        log(f"  {cell.label}: no float32 reference ({device_benchmark._reason(e)})")
        reference = None
    tolerance = cfg.tolerance[cell.dtype]
    ready = {}
    for name, exe in compiled.items():
        try:
            if isinstance(exe, Exception):
                raise exe
            (first_s,), out = measure.time_calls(exe, args, 1)
            worst = None if reference is None else _worst(out, reference)
            del out
            memory = measure.compiled_memory(exe)  # the fused backward's dq partials show here
            rows[name] |= dict(
                first_call_s=first_s,
                rel_diff_vs_float32=worst,
                accurate=None if worst is None else worst <= tolerance,
                temp_mib=None if memory is None else memory["temp"] / 2**20,
            )
            ready[name] = exe
        except Exception as e:  # e.g. out of memory, a launch the device refuses
            rows[name]["unavailable"] = device_benchmark._reason(e)
    del reference
    per_round = {name: [] for name in ready}
    # A call past cfg.long_call_s is long beside a launch's noise: one a round is enough.
    steps = {n: 1 if rows[n]["first_call_s"] > cfg.long_call_s else cfg.steps for n in ready}
    for _ in range(cfg.rounds):
        for name, exe in ready.items():
            seconds, _ = measure.time_calls(exe, args, steps[name])
            per_round[name].append(statistics.median(seconds))
    fastest = min((statistics.median(t) for t in per_round.values()), default=None)
    for name, times in per_round.items():
        rows[name] |= dict(
            time_ms=statistics.median(times) * 1e3,
            rounds_ms=[t * 1e3 for t in times],
            ratio_to_fastest=statistics.median(times) / fastest,
        )
    log(f"  {cell.label}: {len(ready)} of {len(rows)} candidates timed")
    return list(rows.values())


def time_cells(config: dict[str, Any], seconds: float | None) -> dict[str, Any]:
    """child.call's target: run_group for every group of cells until `seconds` have passed
    (those left are not run): dict(environment, capability, rows)."""
    cfg = ml_collections.ConfigDict(config)
    deadline = None if seconds is None else time.monotonic() + seconds
    cap = capability(cfg.capability) or platforms.gpu_capability()
    head = dict(environment=device_benchmark.environment(), capability=cap and list(cap))
    print(_HEAD + json.dumps(head), flush=True)
    todo, rows = groups(cfg), []
    for i, group in enumerate(todo):
        if cap is None:
            why = "not run: no GPU here and config.capability names none"
            done = [r for cell in group for r in _not_run(cell, why)]
        elif deadline is not None and time.monotonic() > deadline:
            why = "not run: the time budget was spent"
            done = [r for cell in group for r in _not_run(cell, why, cap, cfg)]
        else:
            print(f"[{i + 1}/{len(todo)}] {group[0].shape.name} {group[0].dtype}", flush=True)
            try:
                done = run_group(group, cfg, cap, log=lambda line: print(line, flush=True))
            except Exception as e:  # its inputs did not fit, say
                why = device_benchmark._reason(e)
                done = [r for cell in group for r in _not_run(cell, why, cap, cfg)]
        print(_ROWS + json.dumps(done), flush=True)
        rows += done
    return dict(head, rows=rows)


def _salvage(cfg, lines: list[str], error: Exception) -> dict[str, Any]:
    """time_cells' result from a child that died: the rows of the groups it finished, every
    other cell's candidates 'not run' with the child's last error."""
    head = next((json.loads(x[len(_HEAD) :]) for x in lines if x.startswith(_HEAD)), None)
    if head is None:  # it died before it began: nothing to keep
        raise error
    rows = [r for x in lines if x.startswith(_ROWS) for r in json.loads(x[len(_ROWS) :])]
    ran = {(r["shape"], r["dtype"], r["mode"]) for r in rows}
    cap = head["capability"] and tuple(head["capability"])
    why = f"not run: the sweep's process died ({device_benchmark._reason(error)})"
    for cell in cells(cfg):
        if (cell.shape.name, cell.dtype, cell.mode) not in ran:
            rows += _not_run(cell, why, cap, cfg)
    return dict(head, rows=rows)


def _not_run(cell, why: str, cap=None, cfg=None) -> list[dict]:
    head = dict(level="op", shape=cell.shape.name, dtype=cell.dtype, mode=cell.mode,
                shape_dims=dataclasses.asdict(cell.shape), unavailable=why)  # fmt: skip
    if cap is None:
        return [head | dict(variant="")]
    return [_row(cell, c) | dict(unavailable=why) for c in cell_candidates(cell, cap, cfg)]


def run(cfg: ml_collections.ConfigDict, log=print) -> dict:
    """Every cell in one child process (time_cells), within cfg.time_budget_s (0: none); the
    results and the table entries they give (`table`: {device: entries}). A child that dies
    leaves the groups it finished, the other cells 'not run' with its error (_salvage)."""
    check_config(cfg)
    seconds = cfg.time_budget_s or None
    env = device_benchmark.child_env(cfg)
    if cfg.xla_flags:
        env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {cfg.xla_flags}".strip()
    tagged = []

    def read(line: str) -> None:
        if line.startswith((_HEAD, _ROWS)):
            tagged.append(line)
        else:
            log(line)

    kwargs = dict(config=cfg.to_dict(), seconds=seconds)
    try:
        timed = child.call(f"{__name__}:time_cells", kwargs, log=read, env=env)
    except RuntimeError as e:  # the child died: keep what it finished
        log(
            f"sweep: the child died; keeping the groups it finished ({device_benchmark._reason(e)})"
        )
        timed = _salvage(cfg, tagged, e)
    environment = timed["environment"] | dict(command=" ".join(sys.argv))  # not the child's
    results = dict(environment=environment, capability=timed["capability"], cells=timed["rows"])
    results["table"] = tuning_table.updated({}, [results])
    return results


def write_table(results: dict, cfg, out_dir) -> None:
    """out_dir/tuning.json: the package's table with this device's entries replaced (copy it over
    gated_attention/attention/tuning.json, or run tuning_table on results.json, to install)."""
    from gated_attention.attention import tuning

    current = json.loads(tuning.TABLE_FILE.read_text())
    tuning_table.write(out_dir / "tuning.json", current | results["table"])


def markdown(results: dict[str, Any]) -> str:
    env = results["environment"]
    cap = results["capability"]
    lines = [
        f"Sweep on {env['device_kind']} ({env['backend']}), candidates for compute capability "
        f"{'none' if cap is None else '.'.join(map(str, cap))}, jax {env['jax']}, Python "
        f"{env.get('python', '?')}, {env['date_utc']}: `{env['command']}`",
        "",
        "The table these give (tuning.json; `tuning_table.py` says how):",
        "",
        "| device | dtype | mode | head dim <= | bias | candidate |",
        "| --- | --- | --- | ---: | --- | --- |",
    ]
    for device, entries in results["table"].items():
        for e in entries:
            lines.append(
                f"| {device} | {e['dtype']} | {e['mode']} | {e['max_head_dim']} | "
                f"{e.get('bias', '')} | {e.get('candidate', e['implementation'])} |"
            )
    lines += [
        "",
        "Time: median over interleaved rounds; / fastest: to the cell's fastest candidate. "
        "Difference: max |x - reference| / max |reference| over the outputs, the reference our "
        "XLA implementation in float32 at 'highest' precision on the same rounded inputs. "
        "Temp: XLA's temporary memory of the compiled program (its memory analysis).",
        "",
        "| shape | dtype | mode | candidate | time ms | / fastest | rel. diff | temp MiB |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in results["cells"]:
        head = f"| {r['shape']} | {r['dtype']} | {r['mode']} | {r['variant']} |"
        if "time_ms" not in r:
            lines.append(f"{head} {r.get('unavailable', '')[:140]} | | | |")
            continue
        diff = "" if r["rel_diff_vs_float32"] is None else f"{r['rel_diff_vs_float32']:.1e}"
        diff += " INACCURATE" if r["accurate"] is False else ""
        temp = "" if r.get("temp_mib") is None else measure.figure(r["temp_mib"])
        lines.append(
            f"{head} {measure.figure(r['time_ms'])} | {r['ratio_to_fastest']:.3f} | {diff} | "
            f"{temp} |"
        )
    return "\n".join(lines) + "\n"
