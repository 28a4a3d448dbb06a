"""The SASS proxy (gated_attention_tools/sass_proxy.py): the inner loop of each forward kernel's
sm_90a machine code, its instructions per exponential, and the committed report."""

import json
from pathlib import Path

import pytest

from gated_attention_tools import sass_proxy

ROOT = Path(__file__).resolve().parents[2]
# Instructions per score before the kernels' softmax went to base 2 with fused multiply-adds (the
# kernels at ee7da3e, jax 0.10.2): jnp.exp's accurate sequence cost about 7 of them.
BEFORE_BASE_2 = {
    "ours_pallas": 22.74,
    "ours_mosaic": 19.79,
    "ours_mosaic_dkdv": 19.72,
    "ours_mosaic_dq_dbias": 25.23,
}
REPORT = ROOT / "benchmark_results" / "sass_proxy"

# nvdisasm -c's layout: a function's section, labels, /*address*/ instructions.
DISASSEMBLY = """
        .section        .text.other,"ax",@progbits
other:
        /*0000*/                   MUFU.EX2 R1, R1 ;
        /*0010*/                   EXIT ;
        .section        .text.k,"ax",@progbits
k:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0020*/                   FFMA R2, R2, R3, -R4 ;
        /*0030*/                   MUFU.EX2 R2, R2 ;
        /*0040*/                   MUFU.EX2 R5, R5 ;
        /*0050*/                   LDS R6, [R7] ;
        /*0060*/               @P0 SYNCS.ARRIVE.TRANS64 RZ, [UR8], RZ ;
        /*0070*/                   IADD3 R8, R8, 0x1, RZ ;
        /*0080*/              @!P1 BRA `(.L_x_1) ;
.L_x_2:
        /*0090*/                   MUFU.EX2 R9, R9 ;
        /*00a0*/                   STG.E desc[UR4][R2.64], R9 ;
        /*00b0*/                   BRA `(.L_x_2) ;
"""


def test_the_inner_loop_is_the_backward_branch_with_the_most_exponentials():
    code = sass_proxy.parse_sass(DISASSEMBLY, "k")
    loop = sass_proxy.inner_loop(code)
    assert [op for _, op, _ in loop] == [
        "HGMMA.64", "FFMA", "MUFU.EX2", "MUFU.EX2", "LDS", "SYNCS.ARRIVE.TRANS64",
        "IADD3", "BRA",
    ]  # fmt: skip
    got = sass_proxy.mix(loop)
    assert got["counts"] == {
        "exp": 2, "mma": 1, "float": 1, "integer": 1, "shared": 1, "global": 0, "sync": 1,
        "branch": 1,
    }  # fmt: skip
    assert got["instructions_per_exp"] == 4.0 and got["per_exp"]["float"] == 0.5
    assert got["issue_bound_exp_share"] == 1.0  # 8 / 4, at most 1
    assert sass_proxy.parse_sass(DISASSEMBLY)[0][1] == "MUFU.EX2"  # no name: the first with EX2
    with pytest.raises(ValueError, match=r"function 'nothing' not in the disassembly"):
        sass_proxy.parse_sass(DISASSEMBLY, "nothing")
    with pytest.raises(ValueError, match=r"no loop with an exponential"):
        sass_proxy.inner_loop(sass_proxy.parse_sass(DISASSEMBLY, "other"))


# Two consumer warpgroups' loops (MosaicAttention.consumer_warpgroups) and, after them, a barrier
# wait's retry branching back into the first: a span over both, with twice their exponentials.
TWO_LOOPS = """
        .section        .text.k,"ax",@progbits
k:
.L_x_1:
        /*0000*/                   MUFU.EX2 R2, R2 ;
.L_x_2:
        /*0010*/                   MUFU.EX2 R3, R3 ;
        /*0020*/                   MUFU.EX2 R4, R4 ;
        /*0030*/              @!P1 BRA `(.L_x_2) ;
.L_x_3:
        /*0040*/                   MUFU.EX2 R5, R5 ;
        /*0050*/              @!P1 BRA `(.L_x_3) ;
        /*0060*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R0 ;
        /*0070*/              @!P0 BRA `(.L_x_1) ;
"""


def test_a_span_over_other_loops_is_not_the_inner_loop():
    loop = sass_proxy.inner_loop(sass_proxy.parse_sass(TWO_LOOPS, "k"))
    assert [op for _, op, _ in loop] == ["MUFU.EX2", "MUFU.EX2", "BRA"]


def test_the_committed_report_is_its_results_rendered():
    results = json.loads((REPORT / "results.json").read_text())
    rows = results["rows"]
    assert (REPORT / "results.md").read_text() == sass_proxy.markdown(rows, results)
    measured = {r["kernel"] for r in rows if "error" not in r}
    assert {"ours_mosaic", "ours_pallas"} <= measured and len(
        measured - {"ours_mosaic", "ours_pallas"}
    ) >= 2


def test_the_proxy_reads_our_kernel_and_colabfolds_from_their_compiles(tmp_path):
    import jax

    why = sass_proxy.missing()
    if why:
        pytest.skip(why)
    committed = json.loads((REPORT / "results.json").read_text())
    if jax.__version__ != committed["jax"]:  # the machine code is jax's lowering's
        pytest.skip(f"the report is for jax {committed['jax']}, this is {jax.__version__}")
    kernels = ",".join([*BEFORE_BASE_2, "colabfold_tri_flash"])
    sass_proxy.main(["--out", str(tmp_path), "--kernels", kernels])
    rows = {r["kernel"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    for kernel, row in rows.items():
        assert "error" not in row, row
        assert row["counts"]["exp"] >= 8 and row["counts"]["mma"] >= 1, (kernel, row)
        assert 4 < row["instructions_per_exp"] < 60, (kernel, row)
    by_kernel = {r["kernel"]: r for r in committed["rows"]}
    for kernel, row in rows.items():  # the same compilers, the same machine code
        assert row["counts"] == by_kernel[kernel]["counts"], kernel
    for kernel, before in BEFORE_BASE_2.items():  # issues 47 and 48: fewer than before
        assert rows[kernel]["instructions_per_exp"] < before - 4, rows[kernel]
    for kernel in ("ours_pallas", "ours_mosaic"):  # and forwards leaner than ColabFold's
        colabfold = rows["colabfold_tri_flash"]["instructions_per_exp"]
        assert rows[kernel]["instructions_per_exp"] < colabfold, rows[kernel]
