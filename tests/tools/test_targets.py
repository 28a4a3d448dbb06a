"""Compiles for GPU and TPU targets with XLA's real compilers, on this CPU machine (targets.py):
'auto' chooses by the target the program is compiled for, not the host, and the device memory of
a training step there. Each compile runs in a child process; the tests skip, saying what to
install, where the targets extra is missing."""

from __future__ import annotations

import math

import jax
import pytest

from gated_attention_tools import compile_memory, targets


def _need(name: str) -> None:
    reason = targets.missing(name)
    if reason:
        pytest.skip(f"cannot compile for {name}: {reason}")


def test_a_missing_extra_is_a_reason_to_skip_not_an_error(monkeypatch):
    """Without the targets extra the target tests skip with what to install: a plugin whose
    parent package (jax_plugins) is missing is 'not installed', not a ModuleNotFoundError."""
    assert not targets.installed("gated_attention_no_such_package.plugin")
    assert targets.installed("jax.numpy")
    monkeypatch.setattr(targets, "installed", lambda module: False)
    for name in ("h100", "v5e"):
        assert "install the targets extra" in targets.missing(name)


# target, dtype, what 'auto' chooses there, the kernel in its program, the compute dtype.
AUTO_CASES = [
    # tuning.json: measured fastest there, the Triton kernel for inference and the Mosaic
    # kernel for the training step that this program is.
    ("h100", "bfloat16", "pallas (inference), mosaic (training)", "mosaic_gpu", "bfloat16"),
    ("a100", "float32", "pallas", "triton", "float32"),
    # Ada (sm_89) and consumer / workstation Blackwell (sm_120), 99 KiB of shared memory a block:
    # the Mosaic kernel refused (wgmma is Hopper's), the Triton kernel with the small class's
    # tiles (benchmark_results/gpu_kernels/rtx4090.md, rtx6000pro.md).
    ("rtx4090", "bfloat16", "pallas", "triton", "bfloat16"),
    ("rtx6000pro", "float32", "pallas", "triton", "float32"),
    ("v5e", "bfloat16", "pallas_tpu", "mosaic_tpu", "bfloat16"),
]


def _available(cases):
    """The cases whose target compiles here (skip the test where none does)."""
    available = [case for case in cases if not targets.missing(case[0])]
    if not available:
        pytest.skip(
            f"cannot compile for any of {[c[0] for c in cases]}: {targets.missing(cases[0][0])}"
        )
    return available


def test_auto_chooses_for_the_target_not_the_host():
    """The op's choice per target (the Mosaic GPU kernel on Hopper, with no word of Pallas's
    deprecated Triton backend on that path; the Triton kernel on an A100); on the H100, a
    bfloat16 Attention module's too: its op computes in bfloat16 on the GPU (the module's cast
    follows the target, as the op's choice does), the CPU branch staged beside it in float32.
    Every target in one child: the compilers start once."""
    cases = _available(AUTO_CASES)
    kwargs = [dict(target=c[0], dtype=c[1], module=c[0] == "h100") for c in cases]
    results = targets.in_child(
        "tests.target_cases:each", dict(function="auto_choice", cases=kwargs)
    )
    for (target, _, chosen, kernel, compute), got in zip(cases, results, strict=True):
        _check_auto_choice(target, chosen, kernel, compute, got)


def _check_auto_choice(target, chosen, kernel, compute, got):
    if got["module"] is not None:
        calls = got["module"]["calls"]
        assert any("gpu" in c for c in calls) and any("cpu" in c for c in calls), calls
        assert all(c.get("gpu", "bfloat16") == "bfloat16" for c in calls), calls
        assert all(c.get("cpu", "float32") == "float32" for c in calls), calls
    kind = targets.target(target).kind
    assert kind in got["compilable"], (target, got["compilable"])
    assert got["by_platform"][kind]["chosen"] == chosen, (target, got["by_platform"])
    arch = targets.target(target).arch
    if arch in ("sm_89", "sm_120"):  # the Mosaic kernel refused for the GPU's own capability
        reason = got["by_platform"][kind]["reason"]
        assert (
            f"mosaic refused: the Mosaic GPU kernel uses Hopper's wgmma: sm_90 GPUs only, this one is {arch}"
            in reason
        ), reason
    assert got["by_platform"][kind]["compute_dtype"] == compute, target
    # The host (CPU) computes half precision in float32 and never takes a GPU kernel.
    host = got["by_platform"]["cpu"]
    assert (host["chosen"], host["compute_dtype"]) == ("xla", "float32"), (target, host)
    for name in ("triton", "mosaic_gpu", "mosaic_tpu"):
        assert got["target"][name] == (name == kernel), (target, name, got["target"])
        assert not got["host"][name], target
    if kernel != "triton":
        assert got["warnings"] == [], (target, got["warnings"])
    assert 0 < got["memory"]["peak"] < 2**24, target


# AF2's triangle / MSA-row form in bfloat16 (one case: the suite's time; the rest of the forms,
# dtypes and head dims are the kernel matrix's, benchmark_results/gpu_kernels/b200.md).
B200_AUTO_CASES = [dict(dtype="bfloat16", head_dim=32, bias="shared", mask="key")]


@pytest.mark.parametrize("case", B200_AUTO_CASES, ids=lambda c: f"{c['dtype']}-H{c['head_dim']}")
def test_auto_on_a_b200_compiles_the_pallas_kernels_without_spills(case):
    """The op under 'auto' compiled for a B200 (sm_100a, XLA's published config, ptxas 12.9): the
    forward and a training step (a loss's gradient in q, k, v and the bias) each choose the
    Pallas (Triton) kernel for the GPU, and every kernel compiles with 0 spill bytes and dots on
    the tensor cores (tcgen05.mma there). The whole kernel matrix: benchmark_results/gpu_kernels/
    b200.md."""
    from gated_attention_tools.kernel_matrix import pallas_triton

    _need("b200")
    b200 = targets.target("b200")
    config = (targets.CONFIG_DIR / b200.config).read_text()
    assert f"device_memory_size: {b200.memory_bytes}\n" in config
    assert f"shared_memory_per_block_optin: {b200.shared_memory_bytes}\n" in config
    got = targets.in_child("tests.target_cases:auto_kernels", dict(target="b200", **case))
    if not got["forward"]["ptx_files"]:
        import jax

        pytest.skip(f"jax {jax.__version__}'s deviceless GPU compile dumps no PTX files to read")
    expected = dict(forward={"gated_attention_forward"}, training=set(pallas_triton.KERNELS))
    for program, kernels in expected.items():
        result = got[program]
        assert result["calls"] == 1 and result["triton"], (program, result)
        gpu = result["by_platform"]["gpu"]
        assert (gpu["chosen"], gpu["compute_dtype"]) == ("pallas", case["dtype"]), (program, gpu)
        assert result["by_platform"]["cpu"]["chosen"] != "pallas", result["by_platform"]
        assert set(result["kernels"]) == kernels, (program, result["kernels"])
        for name, k in result["kernels"].items():
            assert k["spill_store_bytes"] == k["spill_load_bytes"] == 0, (program, name, k)
            assert k["mma"], (program, name, k)


N_RES = 256


def test_triangle_gradient_memory_on_the_target(target="v5e"):
    """The op's gradient at a 256^2 triangle (bfloat16, shared bias, cotangent an argument)
    compiled for a TPU v5e: its temporaries stay a small fraction of the float32 logits of one
    dense pass ([N, 4, N, N], what AF2 and jax.nn's XLA path hold), which are never built. (Per
    module, target and crop, against AF2's: the device_memory preset of compile_memory.)"""
    _need(target)
    got = targets.in_child(
        "tests.target_cases:triangle_op_memory", dict(target=target, n_res=N_RES)
    )
    logits = N_RES * 4 * N_RES * N_RES * 4
    assert got["chosen"] == "pallas_tpu", got
    memory = got["memory"]
    assert memory["argument"] >= 4 * N_RES**2 * 4 * 32 * 2, memory  # q, k, v, the cotangent
    assert memory["temp"] <= logits // 8, (memory, logits)


# A covering subset of kernel_matrix.pallas_mosaic_tpu.matrix(): every dtype, bias and mask form.
TPU_KERNEL_CASES = {
    "v5e": [
        dict(dtype="bfloat16", head_dim=32, bias="both", mask="key"),
        dict(dtype="float32", head_dim=128, bias="per_row", mask="full"),
        dict(dtype="bfloat16", head_dim=32, bias="both", mask="key", options=True),
    ],
    "v5p": [
        dict(dtype="float32", head_dim=8, bias="shared", mask="none"),
        dict(dtype="bfloat16", head_dim=64, bias="none", mask="key"),
    ],
    "v6e": [
        dict(dtype="bfloat16", head_dim=16, bias="per_row", mask="none"),
        dict(dtype="float32", head_dim=32, bias="both", mask="full"),
    ],
}


def test_tpu_kernels_compile_within_vmem():
    """The Pallas TPU kernels' forward and gradient compile for each TPU generation (300 queries
    and 260 keys: partial tiles); Mosaic refuses a kernel over the scoped VMEM, so a compile says
    every kernel fits. Every generation in one child: libtpu starts once. The whole matrix:
    benchmark_results/tpu_kernels/."""
    from gated_attention_tools.kernel_matrix import pallas_mosaic_tpu

    names = [(target,) for target in sorted(TPU_KERNEL_CASES)]
    available = [name for (name,) in _available(names)]
    kwargs = [dict(target=target, cases=TPU_KERNEL_CASES[target]) for target in available]
    function = "gated_attention_tools.kernel_matrix.pallas_mosaic_tpu:compile_cases"
    all_results = targets.in_child("tests.target_cases:each", dict(function=function, cases=kwargs))
    for target, results in zip(available, all_results, strict=True):
        for case, result in zip(TPU_KERNEL_CASES[target], results, strict=True):
            assert pallas_mosaic_tpu.verdict(result) == [], (target, case, result)
            expected = set(pallas_mosaic_tpu.KERNELS) - (
                {"gated_attention_tpu_dbias"} if case["bias"] == "none" else set()
            )
            assert set(result["kernels"]) == expected, (target, case, result["kernels"])


def test_a_mesh_of_eight_h100s_and_its_collectives():
    """targets.mesh: 8 H100s (topology 1x1x8), compiled deviceless; a row-split array turned to
    columns is one all-to-all, and collectives() reads its result shape; compile_memory.summarize's
    ratios for the rows over a mesh. (The modules' own collectives on a mesh:
    tests/parallel/test_row_parallel.py.)"""
    _need("h100")
    got = targets.in_child("tests.target_cases:transposed_on_a_mesh", dict(target="h100"))
    assert got["devices"] == 8 and got["kinds"] == ["NVIDIA H100 80GB HBM3"], got
    assert got["collectives"]["all-to-all"] and not got["collectives"]["all-gather"], got
    assert "bf16[" in got["collectives"]["all-to-all"][0], got
    row = dict(placement="rows", mesh=(8,), input_bytes=1000, memory=dict(peak=300))
    row |= dict(collectives=got["collectives"])
    row = compile_memory.summarize(row, dict(memory=dict(peak=1600)))
    assert row["over_ideal"] == 1.5 and row["all_to_all"] == len(got["collectives"]["all-to-all"])


def test_context_memory_summaries():
    """compile_memory.summarize, the keys over a mesh: a ring row's peak against one device's /
    devices, the goal's allowance (1.3x ideal + one K/V shard) and its gathers in K shards;
    longest_fitting: the longest crop that fits per target, module, variant and mode."""
    collectives = {k: [] for k in ("all-gather", "collective-permute")}
    collectives["all-gather"] = ["bf16[2,512]{1,0}"]  # 2 KiB: one K shard (kv_shard_bytes / 2)
    collectives["collective-permute"] = ["bf16[2,512]{1,0}"] * 3
    row = dict(placement="keys", what=compile_memory.OP, mesh=(8,), kv_shard_bytes=4096)
    row |= dict(memory=dict(peak=300), collectives=collectives)
    row = compile_memory.summarize(row, dict(memory=dict(peak=1600)))
    assert row["over_ideal"] == 1.5 and row["allowance"] == 1.3 * 200 + 4096
    assert row["largest_gather_over_k_shard"] == 1.0 and row["permutes"] == 3
    assert "error" in compile_memory.summarize(dict(row), dict(error="no compile"))
    rows = [
        dict(target="h100", what="triangle_start", variant="grid", mode="training", n_res=n, fits=f)
        for n, f in ((16384, True), (32768, False), (8192, True))
    ]
    assert compile_memory.longest_fitting(rows) == [
        dict(target="h100", what="triangle_start", variant="grid", mode="training", n_res=16384)
    ]


def test_the_grid_cells_tile_each_modules_input():
    """compile_memory's grid cells (the context_memory suite): TriangleAttention's pair [N, N, 128]
    and MSA column global attention's extra MSA [S, N, 64], each with its mask (and in training
    the update's cotangent) tiled over (rows, cols), the parameters replicated; the table names
    the extra MSA's rows. Traced only (no compile)."""
    from jax.sharding import PartitionSpec as P

    cells = [("triangle_end", 1, (32, 32, 128)), ("msa_column_global", 48, (48, 32, 64))]
    for what, n_seq, shape in cells:
        cell = compile_memory.Cell(
            "keys", "h100", what, "grid", 32, n_seq, "bfloat16", "training", mesh=(2, 4)
        )
        p = compile_memory.problem(cell)
        assert [tuple(a.shape) for a in p.args[1:]] == [shape, shape[:2], shape], what
        assert p.specs == [P(), *[P("rows", "cols")] * 3], what
        assert p.sizes["pair_share"] == math.prod(shape) * 2 // 8, what
        auto = (jax.sharding.AxisType.Auto,) * 2
        with jax.set_mesh(jax.make_mesh((2, 4), p.axes, auto, devices=jax.devices()[:8])):
            out = jax.eval_shape(p.fn, *p.args)
        assert jax.tree.leaves(out)[0].shape == shape, what
    row = dict(what="msa_column_global", n_seq=5120)
    assert compile_memory._module(row) == "msa_column_global (S 5,120)"
    assert compile_memory._module(dict(what="triangle_end", n_seq=1)) == "triangle_end"
