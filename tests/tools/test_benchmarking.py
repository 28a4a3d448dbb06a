"""The benchmark's logic and script (no timing is asserted: speed lives in benchmark output)."""

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import statistics
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from gated_attention.af2 import config
from gated_attention_tools import (
    benchmark,
    compile_memory,
    design_benchmark,
    design_model,
    device_benchmark,
    family_benchmark,
    measure,
    options_benchmark,
    profile,
    sweep,
    targets,
)
from tests.helpers import benchmark_configs

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _bench_module():
    """configs/benchmark.py as a module (configs/ is not a package)."""
    return benchmark_configs()


def _bench_config(preset: str):
    return _bench_module().get_config(preset)


def test_run_cell_rows_are_consistent():
    shape = benchmark.Shape("tiny", 2, 16, 8, 2, True, "key")
    rows = benchmark.run_cell(
        shape,
        "float32",
        "forward_backward",
        ["chunked"],
        rounds=2,
        steps=1,
        log=lambda s: None,
    )
    by_variant = {r["variant"]: r for r in rows}
    assert set(by_variant) == {"chunked", benchmark.AF2, benchmark.ROOFLINE}
    assert by_variant[benchmark.AF2]["ratio_to_af2"] == 1.0
    assert by_variant[benchmark.ROOFLINE]["percent_of_roofline"] == pytest.approx(100.0)
    for r in rows:
        assert r["time_ms"] > 0 and len(r["rounds_ms"]) == 2
        if r["variant"] != benchmark.ROOFLINE:  # same params and inputs: same gradients as AF2
            assert r["rel_diff_vs_af2_float32"] < 1e-5
        # The ratio is per round (against AF2's time in the same round), its median and range.
        ratios = [
            t / t_af2
            for t, t_af2 in zip(r["rounds_ms"], by_variant[benchmark.AF2]["rounds_ms"], strict=True)
        ]
        assert r["ratio_to_af2"] == pytest.approx(statistics.median(ratios))
        assert r["ratio_range"] == pytest.approx([min(ratios), max(ratios)])
        steal = r["cpu_steal_percent"]
        assert steal is None or 0 <= steal <= 100
    assert shape.flops() == 2 * 2 * 16 * 8 * 8 * 5 + 2 * 2 * 16 * 16 * 8 * 2


TINY = ("tiny", 2, 16, 8, 2, True, "key")


@pytest.fixture(scope="module")
def tiny_bfloat16_rows():
    """run_cell's rows, in this process, of a tiny bfloat16 forward cell ('auto' against AF2)."""
    shape = benchmark.Shape(*TINY)
    return benchmark.run_cell(shape, "bfloat16", "forward", ["auto"], 1, 1, log=lambda s: None)


def _check_low_precision_diffs(rows):
    diff = {r["variant"]: r["rel_diff_vs_af2_float32"] for r in rows}
    # Ours computes bfloat16 inputs in float32 on CPU and rounds the output once; AF2's Attention
    # computes in bfloat16 (its softmax too), so its own row is not 0 against its float32 self.
    assert 0 < diff["auto"] < 1e-2
    assert 0 < diff[benchmark.AF2] < 0.1
    assert diff[benchmark.ROOFLINE] is None


def test_low_precision_cells_are_compared_with_af2_in_float32(tiny_bfloat16_rows):
    _check_low_precision_diffs(tiny_bfloat16_rows)


def _row(shape, dtype, mode, variant, ratio, low, high):
    return dict(
        shape=shape,
        dtype=dtype,
        mode=mode,
        variant=variant,
        time_ms=10.0,
        ratio_to_af2=ratio,
        ratio_range=[low, high],
        gflops_per_s=1.0,
        percent_of_roofline=50.0,
        temp_bytes=2**20,
        rel_diff_vs_af2_float32=1e-7,
        cpu_steal_percent=12.5,
    )


def test_goals_are_judged_on_auto_forward_median_ratios():
    rows = [
        _row("a", "float32", "forward", "auto", 0.11, 0.10, 0.13),
        _row("a", "bfloat16", "forward", "auto", 0.125, 0.12, 0.13),
        _row("a", "float32", "forward", "xla", 0.05, 0.05, 0.05),  # not the default: ignored
        _row("a", "float32", "forward_backward", "auto", 0.01, 0.01, 0.01),  # not forward
        _row("b", "float32", "forward", "auto", 0.5, 0.4, 0.6),  # no goal
    ]
    goals = benchmark.goal_rows(rows, [("a", 0.12)])
    assert [(g["dtype"], g["ratio"], g["met"]) for g in goals] == [
        ("float32", 0.11, True),
        ("bfloat16", 0.125, False),
    ]
    table = benchmark.markdown(rows, [], [("a", 0.12)])
    assert table.startswith(
        "AF2: AlphaFold 2's Attention and TriangleAttention (alphafold-colabfold "
    )
    assert "| a | float32 | 0.12 | 0.110 (0.10-0.13) | yes |" in table
    assert "| a | bfloat16 | 0.12 | 0.125 (0.12-0.13) | no |" in table
    assert "| a | float32 | forward | xla | 10.0 | 0.050 (0.05-0.05) |" in table
    assert table.rstrip().endswith("| 1.0 | 1.0e-07 | 12 |  |")
    assert "goal shape" not in benchmark.markdown(rows, [])


@pytest.mark.parametrize(
    "goals, modes, implementations, match",
    [
        ([("c", 0.1)], ("forward",), ("auto",), r"names shape 'c', which is not swept"),
        ([("a", 0)], ("forward",), ("auto",), r"\(shape name, ratio > 0\) pairs, got \('a', 0\)"),
        ([("a",)], ("forward",), ("auto",), r"pairs, got \('a',\)"),
        ([("a", "0.1")], ("forward",), ("auto",), r"pairs, got \('a', '0.1'\)"),
        ([("a", 0.1)], ("forward_backward",), ("auto",), r"modes is \('forward_backward',\)"),
        ([("a", 0.1)], ("forward",), ("xla",), r"implementations is \('xla',\)"),
    ],
)
def test_bad_goals_are_rejected_before_anything_runs(goals, modes, implementations, match):
    with pytest.raises(ValueError, match=match):
        benchmark.check_goals(goals, {"a", "b"}, modes, implementations)
    benchmark.check_goals([("a", 0.1), ("b", 1)], {"a", "b"}, ("forward",), ("auto", "xla"))


def test_steal_percent():
    assert measure.steal_percent((10, 1000), (30, 1200)) == pytest.approx(10.0)
    assert measure.steal_percent(None, (30, 1200)) is None
    assert measure.steal_percent((10, 1000), (10, 1000)) is None  # no tick elapsed
    ticks = measure.cpu_ticks()
    if pathlib.Path("/proc/stat").exists():
        steal, total = ticks
        assert 0 <= steal <= total
    else:
        assert ticks is None


def test_memory_case_reports_temp_and_resident_memory_against_goals():
    case = benchmark.MemoryCase(
        "small", 1, 2, 2048, 16, True, forward_goal_mib=1.0, backward_goal_mib=2.0
    )
    chunked = benchmark.memory_case(case, "chunked")
    # The chunked op never holds the [1, 2, 2048, 2048] float32 logits (32 MiB), only a few
    # 256 x 512 tiles of 1 MiB (the forward's bounded pass and its fallback each have their own).
    logits_mib = 2 * 2048 * 2048 * 4 / 2**20
    assert 0 < chunked["forward_temp_mib"] < logits_mib / 4
    assert 0 < chunked["forward_backward_temp_mib"] < logits_mib / 2
    # The goals judge the larger of XLA's temp bytes and the resident memory.
    judged = [
        max(chunked[f"{mode}_temp_mib"], chunked[f"{mode}_resident_mib"] or 0.0)
        for mode in ("forward", "forward_backward")
    ]
    assert chunked["meets_goals"] == (judged[0] <= 1.0 and judged[1] <= 2.0)
    dense = dict(chunked, implementation="xla", forward_resident_mib=None)
    table = benchmark.markdown([], [chunked, dense])
    assert (
        "| op memory case | implementation | fwd temp (MiB) | fwd resident (MiB) | goal |" in table
    )
    assert "| small | chunked |" in table
    assert f"| small | xla | {chunked['forward_temp_mib']:.1f} |  | 1 |" in table


def _ones_summed(mib):
    """fn(x) that materializes a `mib` MiB float32 temporary (no input that size), and x's spec."""

    def fn(x):
        return jnp.sum(jnp.cumsum(jnp.ones((mib * 2**18,), jnp.float32) * x))

    return fn, (jax.ShapeDtypeStruct((), jnp.float32),)


RESIDENT_KEYS = ("resident_mib", "baseline_mib", "peak_mib", "output_mib")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc/self")
def test_resident_memory_probe_runs_a_case_in_a_fresh_process():
    case = benchmark.MemoryCase("tiny", 1, 2, 64, 8, True, 1.0, 1.0)
    tiny = measure.resident_memory(
        "gated_attention_tools.benchmark:memory_problem",
        dict(case=dataclasses.asdict(case), implementation="xla", dtype="float32", mode="forward"),
    )
    for key in RESIDENT_KEYS:
        assert isinstance(tiny[key], float) and tiny[key] >= 0, (key, tiny)
    assert tiny["output_mib"] == pytest.approx(64 * 2 * 8 * 4 / 2**20)  # [1, 64, 2, 8] float32
    assert isinstance(tiny["peak_reset"], bool) and tiny["note"]
    large = measure.resident_memory(f"{__name__}:_ones_summed", dict(mib=64))
    assert large["resident_mib"] >= 50, large


def test_resident_memory_probe_reports_a_failing_builder():
    with pytest.raises(RuntimeError, match=r"resident-memory probe of .*_ones_summed.*failed"):
        measure.resident_memory(f"{__name__}:_ones_summed", dict(mib=64, typo=1))


def _untracked() -> set[str] | None:
    """The checkout's untracked files that .gitignore does not cover (None outside a git
    checkout)."""
    try:
        done = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=all"],
            capture_output=True, text=True, cwd=ROOT, timeout=60,
        )  # fmt: skip
    except FileNotFoundError:
        return None
    if done.returncode:
        return None
    return {line[3:] for line in done.stdout.splitlines() if line.startswith("??")}


def test_benchmark_script_smoke():
    """The documented smoke command as a user runs it (no output_dir): it says it is a smoke run,
    writes into a fresh temporary folder whose paths it prints, and leaves no file in the
    checkout that git would show."""
    before = _untracked()
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "benchmark.py"),
            f"--config={ROOT / 'configs' / 'benchmark.py'}:smoke",
            "--config.implementations=('auto',)",  # suite time: each variant is a child process
            "--config.sweep_lengths=()",  # the sweep's cells are the same code as the tiny one's
            "--config.triangle_shapes=()",  # suite time: one child process
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        cwd=ROOT,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    written = [pathlib.Path(line.strip()) for line in result.stdout.splitlines()
               if line.startswith("  /")]  # fmt: skip
    assert {p.name for p in written} == {"results.json", "results.md"}, result.stdout[-2000:]
    out_dir = written[0].parent
    try:
        assert f"wrote 2 files to {out_dir}:" in result.stdout
        assert out_dir.name.startswith("gated_attention_modules_") and ROOT not in out_dir.parents
        assert "smoke run: this checks that the benchmark runs end to end" in result.stdout
        assert "smoke run: the harness ran end to end." in result.stdout
        # The baseline's check and the goals ran; their verdicts are times, which a loaded
        # machine (the suite's other workers) moves: no test asserts a time.
        assert "Baseline check, AF2's time in the harness against AF2 alone" in result.stdout
        results = json.loads((out_dir / "results.json").read_text())
        table = (out_dir / "results.md").read_text()
    finally:
        for path in written:
            path.unlink()
        out_dir.rmdir()
    if before is not None:
        assert _untracked() - before == set()
    shapes = {r["shape"] for r in results["cells"]}
    assert shapes == {"tiny 2x32 c16 h2"}
    # Each cell ran in a child process of its own (child.call), its progress passed on, and the
    # baseline is AF2's package as installed.
    version = importlib.metadata.version("alphafold-colabfold")
    assert results["baseline"] == benchmark.baseline_label() == f"alphafold-colabfold {version}"
    assert "  tiny 2x32 c16 h2 float32 forward: round 1/1 done" in result.stdout
    tiny = {r["variant"]: r for r in results["cells"] if r["shape"].startswith("tiny")}
    assert tiny[benchmark.AF2]["rel_diff_vs_af2_float32"] == 0.0
    assert tiny["auto"]["rel_diff_vs_af2_float32"] < 1e-5
    assert "| tiny 2x32 c16 h2 | float32 | forward | auto |" in table
    assert "[1/1]" in result.stdout  # progress
    goal = _bench_module().SMOKE_GOAL
    assert [(g["shape"], g["goal"]) for g in results["goals"]] == [("tiny 2x32 c16 h2", goal)]
    assert "| goal shape (forward, 'auto') |" in table


def test_presets_write_outside_the_checkout_or_where_git_expects_it():
    """Every preset's output_dir: "" (a *_smoke preset: a fresh temporary folder), or a folder of
    committed results (a rerun updates them), or one .gitignore covers: a documented run leaves
    no file that git would show as untracked."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    module = _bench_module()
    for preset in module.PRESETS:
        cfg = module.get_config(preset)
        assert cfg.smoke == preset.endswith("smoke"), preset
        if cfg.smoke:
            assert cfg.output_dir == "", preset
            continue
        assert not os.path.isabs(cfg.output_dir), (preset, cfg.output_dir)
        results = f"{cfg.output_dir}/results.json"
        tracked = subprocess.run(["git", "ls-files", results], capture_output=True, text=True,
                                 cwd=ROOT).stdout.strip()  # fmt: skip
        ignored = subprocess.run(["git", "check-ignore", "-q", results], cwd=ROOT).returncode == 0
        assert tracked or ignored, f"{preset}: {results} is neither committed nor ignored"


def test_benchmark_presets_share_one_schema():
    module = _bench_module()
    keys = {}
    for preset in module.PRESETS:  # one schema per suite
        cfg = module.get_config(preset)
        keys.setdefault(cfg.suite, set()).add(frozenset(cfg.keys()))
    assert sorted(keys) == [
        "compile_memory", "design", "device", "family", "modules", "options", "sweep",
    ], keys  # fmt: skip
    assert all(len(k) == 1 for k in keys.values()), keys
    for preset in module.PRESETS:
        cfg = module.get_config(preset)
        if cfg.suite == "family":
            whats = {w for w, _, _ in cfg.family_shapes}
            assert whats <= {
                *family_benchmark.MODULES,
                "evoformer",
                "extra_evoformer",
                family_benchmark.MODEL,
            }
            assert {g[1] for g in cfg.goals} <= whats | {m[0] for m in cfg.memory_scaling}
            continue
        if cfg.suite == "compile_memory":  # each placement's cells (device, rows, keys)
            one, rows, keys_ = cfg.one_device_cells, cfg.rows_cells, cfg.keys_cells
            assert len(cfg.placements) == 1 and cfg.placements[0] in compile_memory.PLACEMENTS
            assert set(one.whats) <= set(compile_memory.WHATS)
            assert all(targets.target(t) for t in one.targets)
            assert all(targets.target(t) for t in keys_.targets) and set(keys_.variants) <= {
                "ring",
                "plain",
            }
            assert set(rows.whats) <= set(compile_memory.WHATS) and set(rows.whats) == {
                w for w, _ in rows.crops
            }
            assert all(targets.target(t) for t in rows.targets)
            continue
        if cfg.suite == "design":
            cells = [*cfg.memory_cells, *cfg.longest_cells]
            assert all(targets.target(t).kind == "gpu" for t, _, _, _ in cells)
            assert {c for _, c, _, _ in cells} | {c for c, _ in cfg.time_cells} <= set(
                design_model.CASES
            )
            assert {v for _, _, v, _ in cells} <= set(design_benchmark.VARIANTS)
            continue
        if cfg.suite == "options":
            assert cfg.goal_implementation in cfg.implementations
            assert cfg.goal_implementation in cfg.gqa_implementations
            continue
        if cfg.suite == "device":
            device_benchmark.check_config(cfg)
            assert all(device_benchmark.OpShape(*s).batch >= 1 for s in cfg.op_shapes)
            continue
        if cfg.suite == "sweep":
            sweep.check_config(cfg)
            assert all(device_benchmark.OpShape(*s).batch >= 1 for s in cfg.op_shapes)
            continue
        shapes = [benchmark.Shape(*s) for s in (*cfg.shapes, *cfg.triangle_shapes)]
        assert all(s.module != "triangle_attention" or s.batch == s.length for s in shapes)
    with pytest.raises(ValueError, match=r"preset must be one of"):
        module.get_config("fast")


def test_family_cell_times_af2_and_ours_on_the_same_params():
    """A training-step cell of AF2's own MSAColumnGlobalAttention (the extra MSA's) against ours
    swapped in, ours saving everything for the backward pass (remat_policy): per-round ratios,
    the same gradients, and the goal and memory tables from them."""
    cell = family_benchmark.Cell("msa_column_global", 8, 8, "float32", "training", "everything")
    rows = family_benchmark.run_cell(cell, rounds=2, steps=1, log=lambda s: None)
    by_variant = {r["variant"]: r for r in rows}
    assert set(by_variant) == {family_benchmark.AF2, family_benchmark.OURS}
    ours, af2 = by_variant["ours"], by_variant["af2"]
    assert af2["ratio_to_af2"] == 1.0 and len(ours["rounds_ms"]) == 2
    ratios = [t / a for t, a in zip(ours["rounds_ms"], af2["rounds_ms"], strict=True)]
    assert ours["ratio_to_af2"] == pytest.approx(statistics.median(ratios))
    assert ours["rel_diff_vs_af2_float32"] < 1e-5  # gradients of every parameter and input
    memory = [
        family_benchmark.memory_cell(
            "msa_column_global", "ours", 8, 8, "float32", "training", False
        )
    ]
    assert memory[0]["temp_mib"] > 0 and memory[0]["resident_mib"] is None
    goals = (("time", "msa_column_global", "training", "float32", 1e-9),)
    goals += (("memory", "msa_column_global", 8, 8, 1e6),)
    judged = family_benchmark.goal_rows(rows, memory, goals)
    assert [g["met"] for g in judged] == [False, True]
    results = dict(baseline="alphafold-colabfold x", jax="y", cells=rows, memory=memory)
    table = family_benchmark.markdown(results | dict(goals=judged))
    assert "| msa_column_global 8x8 (saving everything) | float32 | training | ours |" in table
    assert "| msa_column_global 8x8 | ours |" in table


def test_family_cell_with_colabfolds_kernels_says_why_not_off_a_gpu():
    """The family_gpu preset's variants: AF2 as ColabFold runs it on a GPU (use_pallas) and the
    same with ours. In bfloat16 on CPU ColabFold's Pallas attention kernel does not lower, and its
    row says so; with ours swapped in the module holds no ColabFold kernel and runs as ours; AF2
    and ours are timed with their peak memory, and the table shows both kinds of row."""
    variants = ("af2", "colabfold", "ours", "ours_colabfold")
    cell = family_benchmark.Cell("triangle_start", 1, 8, "bfloat16", "inference")
    rows = family_benchmark.run_cell(cell, rounds=1, steps=1, log=lambda s: None, variants=variants)
    by_variant = {r["variant"]: r for r in rows}
    assert set(by_variant) == set(variants)
    assert "interpret mode" in by_variant["colabfold"]["unavailable"], by_variant["colabfold"]
    for v in ("af2", "ours", "ours_colabfold"):
        assert by_variant[v]["time_ms"] > 0 and by_variant[v]["peak_mib"] is not None
    diff = by_variant["ours"]["rel_diff_vs_af2_float32"]
    assert diff < 2e-2 and by_variant["ours_colabfold"]["rel_diff_vs_af2_float32"] == diff
    table = family_benchmark.markdown(dict(baseline="x", jax="y", cells=rows, memory=[], goals=[]))
    assert "| triangle_start 8 | bfloat16 | inference | colabfold | ValueError: " in table
    cfg = _bench_config("family_gpu")
    assert cfg.family_variants == variants and not cfg.baseline_check


def test_longest_search_doubles_then_halves_to_the_step():
    """The family_gpu preset's search for the longest N_res a variant runs (each probe a fresh
    process on the device; here a stand-in that fits up to 3,000): doubling from the start, then
    halving, to the largest multiple of the step that fits; the limit and a start that does not
    fit said as such."""
    tried = []

    def up_to(most):
        return lambda n: tried.append(n) or n <= most

    found = family_benchmark.longest(
        "evoformer", "ours", 4, 1024, 8192, 256, probe=up_to(3000), log=lambda s: None
    )
    assert found["longest"] == 2816 and not found["limit_reached"]
    assert tried == [1024, 2048, 4096, 3072, 2560, 2816]
    everything = family_benchmark.longest(
        "evoformer", "ours", 4, 1024, 8192, 256, probe=up_to(10**6), log=lambda s: None
    )
    assert (everything["longest"], everything["limit_reached"]) == (8192, True)
    none = family_benchmark.longest(
        "evoformer", "ours", 4, 1024, 8192, 256, probe=up_to(10), log=lambda s: None
    )
    assert none["longest"] is None and list(none["probes"]) == [1024]
    assert family_benchmark.fits("triangle_start", "ours", 1, 8, "float32", "inference")
    results = dict(baseline="x", jax="y", cells=[], memory=[], goals=[], longest=[
        dict(what="evoformer", variant="ours", n_seq=4, dtype="bfloat16", **found),
        dict(what="evoformer", variant="af2", n_seq=4, dtype="bfloat16", **everything),
    ])  # fmt: skip
    table = family_benchmark.markdown(results)
    assert "| evoformer 4x, bfloat16 | ours | 2,816 |" in table
    assert "| evoformer 4x, bfloat16 | af2 | 8,192 (the search's limit) |" in table


def test_family_cells_run_ours_at_their_memory_budget():
    """A cell's memory_budget_mib reaches our modules (their row tiles: a tiny budget tiles the
    MSA rows in a loop, the default runs them in one call), names the cell, and a budget that
    is not a positive number is refused before any cell runs."""

    def hlo(budget):
        cell = family_benchmark.Cell("msa_row", 4, 16, "float32", "inference", "nothing", budget)
        fns, args = family_benchmark.cell_problem(cell, (family_benchmark.OURS,))
        return jax.jit(fns[family_benchmark.OURS]).lower(*args).as_text(), cell.name

    tiled, name = hlo(0.01)
    whole, default_name = hlo(None)
    assert "stablehlo.while" in tiled and "stablehlo.while" not in whole
    assert name == "msa_row 4x16 (budget 0.01 MiB)" and default_name == "msa_row 4x16"
    cfg = _bench_config("family_smoke")
    assert cfg.memory_budgets_mib == (None,)
    cfg.memory_budgets_mib = (None, -1.0)
    with pytest.raises(ValueError, match=r"config.memory_budgets_mib entries"):
        family_benchmark.run(cfg, log=lambda s: None)


def test_family_remat_preset_times_each_policy_and_checks_them():
    """configs/benchmark.py:family_remat: the training cells once per remat policy; a policy the
    modules do not know is refused before any cell runs."""
    cfg = _bench_config("family_remat")
    assert cfg.modes == ("training",) and set(cfg.remat_policies) == set(config.REMAT_POLICIES)
    cfg.remat_policies = ("nothing", "all")
    with pytest.raises(ValueError, match=r"config.remat_policies entries must be one of .*'all'"):
        family_benchmark.run(cfg, log=lambda s: None)


def test_family_floor_removes_every_attention_module():
    """The Evoformer floor: AF2's block with each attention module's update zero (and no
    attention parameters), the rest of the block as it ships."""
    cell = family_benchmark.Cell("evoformer", 4, 8, "float32", "inference")
    specs = family_benchmark.input_specs(cell)
    shapes = {
        v: jax.eval_shape(
            family_benchmark.transformed("evoformer", v, False).init, jax.random.PRNGKey(0), *specs
        )
        for v in ("af2", "floor")
    }
    attention = {k for k in shapes["af2"] if "attention" in k and "outer" not in k}
    assert attention and not attention & set(shapes["floor"])
    assert set(shapes["floor"]) == set(shapes["af2"]) - attention
    with pytest.raises(
        ValueError,
        match=r"variant must be one of \('af2', 'ours', 'floor', 'colabfold', 'ours_colabfold'\)",
    ):
        family_benchmark.transformed("evoformer", "fast", False)


def test_profile_places_hlo_instructions_by_kind():
    """The profiler's reading of compiled HLO: names, metadata and output ranks (tuples by their
    largest element), loops left out; and each kind from metadata and rank."""
    hlo = "\n".join(
        [
            '  %ynn_fusion.2 = f32[5376,256]{1,0} fusion(%p), metadata={op_name="a/...qa,ahc->...qhc/dot_general"}',
            '  dot.7 = f32[2,4,256,32]{3,2,1,0} dot(%x, %y), metadata={op_name="a/transpose(jvp())/transpose"}',
            "  ROOT ynn_fusion.3 = f32[8,256,32]{2,1,0} fusion(%a, %b), kind=kCustom",
            '  fusion.1 = (f32[4,8,128,128]{3,2,1,0}, f32[4]{0}) fusion(%c), metadata={op_name="a/reduce_max"}',
            "  while.5 = (s32[], f32[4]{0}) while(%t), condition=%cond, body=%body",
            '  wrapped_broadcast = f32[256,1024,64]{2,1,0} fusion(), metadata={op_name="a/broadcast_in_dim"}',
            '  ynn_fusion.9 = f32[1024,64]{1,0} fusion(%d), metadata={op_name="query_norm/jit(_var)/reduce_sum"}',
            "  add.1 = f32[] add(%e, %f)",
        ]
    )
    ops = profile.hlo_instructions(hlo)
    assert "while.5" not in ops and ops["add.1"] == ("", 0)
    assert ops["fusion.1"] == ("a/reduce_max", 4) and ops["ynn_fusion.3"] == ("", 3)
    kinds = {name: profile.kind(name, *ops[name]) for name in ops}
    assert kinds == {
        "ynn_fusion.2": "projection",
        "dot.7": "attention",
        "ynn_fusion.3": "attention",
        "fusion.1": "attention",
        "wrapped_broadcast": "copy",
        "ynn_fusion.9": "layernorm",
        "add.1": "other",
    }


def test_profile_cell_traces_both_variants_ops():
    """A small MSA row cell profiled: every variant's traced ops are found in its HLO, and its
    projections and attention core have time."""
    cell = family_benchmark.Cell("msa_row", 4, 16, "float32", "inference")
    result = profile.profile_cell(cell, calls=1)
    assert set(result) == {"af2", "ours"}
    for r in result.values():
        assert r["wall_ms"] > 0 and set(r["kinds"]) == set(profile.KINDS)
        assert r["kinds"]["projection"] > 0 and r["kinds"]["attention"] > 0
    table = profile.markdown(cell, result)
    assert table.startswith("| msa_row 4x16 inference | wall | projection | attention |")


# ------------------------------------------------------------------ allocator policy and baseline


def test_allocator_policy_replaces_the_parents_malloc_variables(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    steady = measure.child_env("steady")
    assert steady["MALLOC_MMAP_THRESHOLD_"] == steady["MALLOC_TRIM_THRESHOLD_"] == "4294967296"
    assert "MALLOC_ARENA_MAX" not in steady
    assert not any(k.startswith("MALLOC_") for k in measure.child_env("default"))
    assert measure.child_env()["MALLOC_ARENA_MAX"] == "2"  # None: this process's, as it is
    with pytest.raises(
        ValueError, match=r"allocator must be one of \['default', 'steady'\], got 'tc'"
    ):
        measure.child_env("tc")


def _malloc_env():
    return {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}


def test_child_runs_under_the_allocator_policy():
    from gated_attention_tools import child

    got = child.call(f"{__name__}:_malloc_env", {}, log=lambda s: None, allocator="steady")
    assert got == measure.ALLOCATOR_POLICIES["steady"]


def test_baseline_check_flags_a_cell_whose_af2_time_moved():
    rows = [dict(variant="af2", time_ms=110.0), dict(variant="ours", time_ms=50.0)]
    ok = measure.check_baseline(rows, alone_ms=101.0, tolerance=0.10)
    assert [r["baseline_ok"] for r in ok] == [True, True]
    assert ok[0]["af2_harness_over_alone"] == pytest.approx(110 / 101)
    bad = measure.check_baseline(rows, alone_ms=99.0, tolerance=0.10)  # 1.11x: off by 11 %
    assert not bad[0]["baseline_ok"]
    assert measure.alone_cell(bad[0]) == "99.0, 1.11 FLAGGED" and measure.alone_cell(bad[1]) == ""
    line = measure.allocator_line(
        dict(policy="steady", env={"A": "1"}),
        [r | dict(cell="c", dtype="float32", mode="training") for r in bad],
        "cell",
    )
    assert (
        "'steady' in every child (A=1)" in line
        and "FLAGGED" in line
        and "c float32 training" in line
    )


def test_baseline_alone_times_only_af2():
    cell = family_benchmark.Cell("triangle_start", 1, 8, "float32", "inference")
    rows = family_benchmark.run_cell(cell, 1, 1, log=lambda s: None, variants=("af2",))
    assert [r["variant"] for r in rows] == ["af2"] and rows[0]["time_ms"] > 0
    shape = benchmark.Shape(*TINY)
    rows = benchmark.run_cell(shape, "float32", "forward", ["auto"], 1, 1, lambda s: None, True)
    assert [r["variant"] for r in rows] == [benchmark.AF2]


def test_training_steps_take_the_updates_cotangent():
    """The family and op training steps are the VJP of the cotangent passed in (not of ones):
    their gradients equal jax.grad of sum(update * cotangent)."""
    cell = family_benchmark.Cell("triangle_start", 1, 8, "float32", "training")
    t = family_benchmark.transformed("triangle_start", "ours", True)
    specs = family_benchmark.input_specs(cell)
    params = family_benchmark.random_params(t, specs)
    msa, pair, msa_mask, pair_mask = family_benchmark.random_inputs(specs)
    cot = family_benchmark.cotangent(t, params, specs)
    assert float(jnp.std(cot)) > 0.5  # unit-normal, not a constant
    step = jax.jit(family_benchmark.step_fn(t, "triangle_start", "training"))
    grads = step(params, msa, pair, msa_mask, pair_mask, cot)
    key = jax.random.PRNGKey(1)

    def weighted(params, msa, pair):
        return jnp.sum(t.apply(params, key, msa, pair, msa_mask, pair_mask) * cot)

    ones_loss = lambda p, m, x: (
        weighted(p, m, x) * 0 + jnp.sum(t.apply(p, key, m, x, msa_mask, pair_mask))
    )
    # Both references in one jitted program (op by op, their dispatch compiles ~170 programs).
    expected, ones = jax.jit(
        lambda *a: tuple(jax.grad(f, argnums=(0, 1, 2))(*a) for f in (weighted, ones_loss))
    )(params, msa, pair)
    assert family_benchmark.relative_diff(grads, expected) < 1e-5
    assert family_benchmark.relative_diff(grads, ones) > 0.1
    fn, specs = family_benchmark.memory_problem(
        "triangle_start", "ours", 1, 8, "float32", "training"
    )
    assert specs[-1].shape == (8, 8, 128)  # the cotangent is the last input of the program
    fn, specs = benchmark.memory_problem(
        benchmark.MemoryCase("m", 2, 2, 8, 4, True, 1, 1), "xla", "float32", "forward_backward"
    )
    assert len(specs) == 6 and specs[-1].shape == (2, 8, 2, 4)


# --------------------------------------------------------------------------------------- pictures


def test_pictures_are_drawn_from_results(tmp_path):
    pytest.importorskip("matplotlib", reason="the pictures need matplotlib (the test extra has it)")
    from gated_attention_tools import device_summary, plots

    h100 = ROOT / "benchmark_results" / "device" / "h100" / "results.json"
    device_summary.main(["x", "--plot", str(h100), str(tmp_path / "device.png")])
    assert (tmp_path / "device.png").stat().st_size > 10_000

    rows = [
        dict(
            shape=f"sweep 1x{n}",
            length=n,
            mode=m,
            variant=v,
            dtype=d,
            time_ms=n / 10,
            ratio_to_af2=r,
        )
        for n in (512, 1024)
        for m in ("forward", "forward_backward")
        for d in ("float32", "bfloat16")
        for v, r in (("af2", 1.0), ("auto", 0.4), ("matmul", 0.1))
    ]
    plots.op_sweep(rows, str(tmp_path / "op.png"))
    memory = [
        dict(what="triangle_start", variant=v, n_res=n, temp_mib=t * n**p, resident_mib=None)
        for n in (256, 512)
        for v, t, p in (("ours", 1e-3, 2), ("af2", 1e-4, 3))
    ]
    plots.training_memory(memory, str(tmp_path / "memory.png"))
    cells = [
        dict(
            cell="m 8",
            what="m",
            variant="ours",
            dtype="float32",
            mode=mode,
            ratio_to_af2=0.5,
            ratio_range=[0.4, 0.6],
        )
        for mode in ("inference", "training")
    ]
    goals = [dict(what="m", mode="inference", limit=0.5)]
    plots.family_ratios(cells, goals, str(tmp_path / "ratios.png"))
    for name in ("op.png", "memory.png", "ratios.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="no rows whose shape starts with 'sweep'"):
        plots.op_sweep(rows[:0], str(tmp_path / "none.png"))
    with pytest.raises(ValueError, match="no float32 'ours' cells"):
        plots.family_ratios([], goals, str(tmp_path / "none.png"))


def test_device_memory_tables_say_the_longest_crop_that_fits():
    def row(variant, n_res, fits, temp=2**30):
        memory = dict(argument=0, output=0, temp=temp, alias=0, peak=temp)
        cell = dict(target="h100", what="triangle_start", dtype="bfloat16", mode="training")
        return dict(
            cell,
            placement="one_device",
            variant=variant,
            n_res=n_res,
            n_seq=1,
            fits=fits,
            memory=memory,
            pair_bytes=2**29,
            chosen=["pallas"] if variant != "af2" else [],
        )

    rows = [row("af2", 256, True), row("af2", 512, True), row("af2", 1024, False)]
    rows += [row("ours", 256, True), row("ours", 512, True)]
    assert compile_memory.longest(rows, variant="af2") == 512
    assert compile_memory.longest(rows, variant="ours", target="v5e") is None
    config = dict(one_device=dict(msa_rows=512, extra_msa_rows=1024))
    results = dict(placements=["one_device"], versions=dict(jax="x"), config=config, rows=rows)
    table = compile_memory.markdown(results)
    # AF2 ran out of memory at 1,024; ours never did, so its longest is a lower bound.
    assert "| h100 | triangle_start | bfloat16 | training | 512 | >= 512 |" in table
    assert (
        "| h100 | triangle_start | ours | 512 | bfloat16 | training | pallas | 1.00 | 1.00 | 2.00 |"
        in table
    )


def test_options_causal_cell_rows_are_consistent():
    """Causal against full per implementation: per-round ratios of the same rounds, the full
    row's ratio 1."""
    rows = options_benchmark.causal_cell(64, 2, 8, "float32", ["chunked", "xla"], rounds=2, steps=1)
    by = {(r["implementation"], r["variant"]): r for r in rows}
    assert set(by) == {(i, v) for i in ("chunked", "xla") for v in options_benchmark.CAUSAL}
    for impl in ("chunked", "xla"):
        full, causal = by[impl, "full"], by[impl, "causal"]
        assert full["ratio_to_full"] == 1.0
        ratios = [c / f for c, f in zip(causal["round_ms"], full["round_ms"], strict=True)]
        assert causal["ratio_to_full"] == pytest.approx(statistics.median(ratios))
        assert causal["ratio_range"] == [min(ratios), max(ratios)]
        assert causal["time_ms"] == statistics.median(causal["round_ms"])
    only = options_benchmark.causal_cell(
        64, 2, 8, "float32", ["chunked"], rounds=1, steps=1, variants=["chunked/full"]
    )
    assert [(r["implementation"], r["variant"]) for r in only] == [("chunked", "full")]


def test_options_gqa_problem_and_goal():
    """The GQA programs are the op's gradient with the cotangent an argument; the goal compares
    the larger of temp and resident with the one-head case plus what the query heads take
    themselves (multi-head attention with as many key/value heads)."""
    step, specs = options_benchmark.gqa_problem(4, 1, 16, 8, "float32", "chunked", "training")
    assert [s.shape for s in specs] == [(1, 16, 4, 8), (1, 16, 1, 8), (1, 16, 1, 8), (1, 16, 4, 8)]
    args = [jax.random.normal(jax.random.PRNGKey(i), s.shape) for i, s in enumerate(specs)]
    fwd = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla")
    expected = jax.jit(lambda q, k, v, cot: jax.vjp(fwd, q, k, v)[1](cot))(*args)
    for got, want in zip(jax.jit(step)(*args), expected, strict=True):  # eager: a compile per op
        assert jnp.allclose(got, want, atol=1e-5), (got - want).max()

    def cell(heads, kv, temp, resident, impl="chunked"):
        return dict(
            heads=heads,
            kv_heads=kv,
            implementation=impl,
            mode="forward",
            dtype="float32",
            temp_mib=temp,
            resident_mib=resident,
        )

    cells = [cell(8, 1, 5.0, 7.5), cell(1, 1, 3.0, 4.0), cell(8, 8, 6.0, 7.0)]
    [goal] = options_benchmark.gqa_goal(cells, 8)
    assert (goal["gqa_mib"], goal["one_head_mib"], goal["allowed_mib"]) == (7.5, 4.0, 7.0)
    assert not goal["met"]
    [goal] = options_benchmark.gqa_goal([cell(8, 1, 5.0, None), *cells[1:]], 8)
    assert (goal["gqa_mib"], goal["met"]) == (5.0, True)


def test_every_preset_names_a_registered_suite():
    from gated_attention_tools import suites

    module = _bench_module()
    assert {module.get_config(p).suite for p in module.PRESETS} == set(suites.SUITES)
    for suite in suites.SUITES.values():
        tool = importlib.import_module(f"gated_attention_tools.{suite.module}")
        assert callable(tool.run) and callable(tool.markdown)
    cfg = module.get_config("smoke")
    with cfg.unlocked():
        cfg.suite = "modulez"
    with pytest.raises(ValueError, match=r"config.suite must be one of \[.*\], got 'modulez'"):
        suites.run(cfg, ROOT)


def test_design_tables_say_the_ratio_and_the_longest_that_fits():
    gib = 2**30
    memory = [
        dict(target="a100", case="hallucination", length=1024, variant=v, peak_gib=p, fits=p < 80)
        for v, p in (("colabdesign", 90.0), ("ours", 26.1))
    ]
    longest = [
        dict(target="a100", case="hallucination", length=n, variant=v, fits=f)
        for v, n, f in (("colabdesign", 896, True), ("colabdesign", 1024, False),
                        ("ours", 1792, True), ("ours", 2048, False))
    ]  # fmt: skip
    time_rows = measure.check_baseline(
        [dict(case="hallucination", length=128, dtype="float32", variant=v, time_ms=t)
         for v, t in (("colabdesign", 100.0), ("ours", 80.0))],
        101.0, 0.1, design_benchmark.BASELINE,
    )  # fmt: skip
    time_rows = [
        r | dict(over_baseline=r["time_ms"] / 100.0, resident_mib=gib / 2**20) for r in time_rows
    ]
    table = design_benchmark.markdown(
        dict(memory=memory, longest=longest, time=time_rows, allocator="steady")
    )
    assert "| a100 | hallucination | 1024 | 90.00 GiB | 26.10 GiB | 0.29 |" in table
    assert "| a100 | hallucination | 896 | 1792 | 2.00 |" in table
    assert "| hallucination | 128 | float32 | ours | 80.0 | 0.80 | 1024 |" in table
    assert "every cell within the tolerance" in table


def test_search_longest_walks_up_or_down_to_the_change():
    at = lambda n: dict(n=n, fits=n <= 900)
    assert [r["n"] for r in targets.search_longest(at, 768, 128)] == [768, 896, 1024]
    assert [r["n"] for r in targets.search_longest(at, 1152, 128)] == [1152, 1024, 896]
    never = targets.search_longest(lambda n: dict(n=n, fits=False), 256, 128)
    assert [r["n"] for r in never] == [256, 128]  # down to the step, then no length is left
