"""The Pallas kernels compiled for an A100 (sm_80) and an H100 (sm_90) by XLA's GPU compiler and
ptxas, deviceless (gated_attention_tools/kernel_matrix/pallas_triton.py): with the tiles of
pallas_tiles' table (two cases here are forms whose tiles differ from the heaviest form's), every
kernel of a case compiles with 0 spill bytes, within the target's shared memory, and with
tensor-core MMA instructions wherever the precision allows them. A covering subset of the matrix
(every dtype, every padded head dim, every bias and mask form, both targets, lengths that are not
multiples of the tiles, float32 at each precision, and the op's further arguments: GQA, causal,
window, lengths, soft cap), and AF2's form positions first (the columns read in place); benchmark_results/gpu_kernels/ has the whole matrix."""

from __future__ import annotations

import pytest

from gated_attention_tools import targets
from gated_attention_tools.kernel_matrix import pallas_triton

CASES = {
    "a100": [
        dict(dtype="float32", head_dim=128, bias="shared", mask="key", precision="high"),
        dict(dtype="float16", head_dim=16, bias="per_row", mask="none"),
        dict(dtype="bfloat16", head_dim=64, bias="both", mask="full"),
        dict(dtype="bfloat16", head_dim=32, bias="both", mask="key", options=True),
    ],
    "h100": [
        dict(dtype="float32", head_dim=32, bias="none", mask="full"),
        dict(dtype="bfloat16", head_dim=128, bias="shared", mask="key"),
        dict(dtype="float32", head_dim=8, bias="both", mask="key", precision="high"),
        dict(
            dtype="float32", head_dim=16, bias="both", mask="key", options=True, precision="highest"
        ),
    ],
}


def test_kernels_compile_without_spills_and_use_the_tensor_cores():
    """Every target's cases in one child (the compilers start once)."""
    available = [target for target in sorted(CASES) if not targets.missing(target)]
    if not available:
        pytest.skip(f"cannot compile for {sorted(CASES)}: {targets.missing(sorted(CASES)[0])}")
    cases = {t: [dict(dict(precision="default"), **case) for case in CASES[t]] for t in available}
    kwargs = [dict(target=t, cases=cases[t]) for t in available]
    all_results = targets.in_child(
        "tests.target_cases:each", dict(function="kernel_cases", cases=kwargs)
    )
    if not all_results[0][0]["ptx_files"]:  # then the only result (tests/target_cases.py)
        import jax

        pytest.skip(
            f"jax {jax.__version__}'s deviceless GPU compile dumps no PTX files to read (seen "
            "with 0.12.0.1); these checks run on jax 0.10.2"
        )
    for target, results in zip(available, all_results, strict=True):
        for case, stats in zip(cases[target], results, strict=True):
            assert set(stats["kernels"]) == set(pallas_triton.KERNELS), (target, case, stats)
            assert pallas_triton.verdict(target, case, stats) == [], (
                target,
                case,
                stats["kernels"],
            )
            ieee = case["dtype"] == "float32" and case["precision"] == "highest"
            assert all(k["mma"] != ieee for k in stats["kernels"].values()), (target, case)


# AF2's form in bfloat16 (as the column-wise modules hand it too: positions first), float32
# (TF32 wgmma) with both bias forms, a full mask and every further argument, and the forward with
# two consumer warpgroups, as a grid and persistent; the whole matrix:
# benchmark_results/mosaic_kernels/h100.md.
MOSAIC_CASES = [
    dict(dtype="bfloat16", head_dim=32, bias="shared", mask="key"),
    dict(dtype="bfloat16", head_dim=32, bias="shared", mask="key", positions_first=True),
    dict(dtype="float32", head_dim=16, bias="both", mask="full", options=True),
    # Two consumer warpgroups (setmaxnreg, named barriers), a bias with a query dim per consumer;
    # a form of its own, so that the backward kernels compile (and dump) in this row too.
    dict(dtype="bfloat16", head_dim=16, bias="both", mask="key", consumer_warpgroups=2),
    # The persistent forward (one program per multiprocessor looping over tiles), two consumers.
    dict(
        dtype="float16",
        head_dim=32,
        bias="shared",
        mask="key",
        consumer_warpgroups=2,
        persistent=True,
    ),
]


def test_mosaic_kernels_compile_for_hopper_without_spills_on_wgmma():
    """The Mosaic GPU kernels compiled for an H100 (sm_90a): each of the three compiles with 0
    spill bytes and wgmma instructions, within the H100's shared memory
    (kernel_matrix/pallas_mosaic_gpu.py)."""
    from gated_attention_tools.kernel_matrix import pallas_mosaic_gpu

    reason = targets.missing("h100")
    if reason:
        pytest.skip(f"cannot compile for h100: {reason}")
    cases = [dict(case, precision="default") for case in MOSAIC_CASES]
    rows = pallas_mosaic_gpu.run(cases, per_child=len(cases), log=lambda line: None)
    for row in rows:
        assert "refused" not in row and row["problems"] == [], row
        assert set(row["kernels"]) == set(pallas_mosaic_gpu.KERNELS), row["kernels"]
        for kernel in row["kernels"].values():
            assert kernel["arch"] == "sm_90a" and kernel["wgmma"], kernel
