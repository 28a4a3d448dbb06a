"""What runs around the attention kernel in a family module compiled for a GPU without one
(gated_attention_tools/module_passes.py): the reader of the compiled program, and the modules'
counts at AF2's channels on an H100 (row loops; copy passes of activation-sized tensors)."""

from __future__ import annotations

import pytest

from gated_attention_tools import module_passes, targets

HLO = """\
HloModule m

%fused_transpose (p0: bf16[64,32,8]) -> bf16[32,64,8] {
  %p0 = bf16[64,32,8]{2,1,0} parameter(0)
  ROOT %t = bf16[32,64,8]{2,1,0} transpose(%p0), dimensions={1,0,2}
}

%fused_gate (p0: bf16[64,32,8], p1: bf16[64,32,8]) -> bf16[64,32,8] {
  %p0 = bf16[64,32,8]{2,1,0} parameter(0)
  %p1 = bf16[64,32,8]{2,1,0} parameter(1)
  %l = bf16[64,32,8]{2,1,0} logistic(%p1)
  ROOT %m = bf16[64,32,8]{2,1,0} multiply(%p0, %l)
}

%fused_small (p0: bf16[4,32,8]) -> bf16[32,4,8] {
  %p0 = bf16[4,32,8]{2,1,0} parameter(0)
  ROOT %t = bf16[32,4,8]{2,1,0} transpose(%p0), dimensions={1,0,2}
}

%fused_fill () -> bf16[64,32,8] {
  %z = bf16[] constant(0)
  ROOT %b = bf16[64,32,8]{2,1,0} broadcast(%z), dimensions={}
}

ENTRY %main (x: bf16[64,32,8], s: bf16[4,32,8]) -> bf16[32,64,8] {
  %x = bf16[64,32,8]{2,1,0} parameter(0)
  %s = bf16[4,32,8]{2,1,0} parameter(1)
  %g = bf16[64,32,8]{2,1,0} fusion(%x, %x), kind=kLoop, calls=%fused_gate
  %small = bf16[32,4,8]{2,1,0} fusion(%s), kind=kLoop, calls=%fused_small
  %c = bf16[64,32,8]{2,1,0} copy(%g)
  %f = bf16[64,32,8]{2,1,0} fusion(), kind=kLoop, calls=%fused_fill
  %w = (s32[], bf16[64,32,8]) while(%tuple), condition=%cond, body=%body
  ROOT %t = bf16[32,64,8]{2,1,0} fusion(%c), kind=kLoop, calls=%fused_transpose
}
"""


def test_the_reader_counts_loops_and_data_moves_of_activation_size_only():
    """A transpose fusion and a copy of 16,384 elements are passes; the gate's fusion computes,
    a row tile's transpose is small, a fill of zeros reads nothing, and none is one; the while
    loop is counted."""
    found = module_passes.count(HLO, min_elements=64 * 32 * 8 // 2)
    assert found["loops"] == 1
    assert found["passes"] == [("copy", "bf16[64,32,8]"), ("fusion(transpose)", "bf16[32,64,8]")]
    assert module_passes.count(HLO, min_elements=10**6) == dict(loops=1, passes=[])


def test_the_modules_compile_for_a_gpu_as_one_call():
    """On an 80 GB H100 (deviceless, bfloat16, model_1's channels) a module whose rows fit the
    GPU's share of memory (global_config.gpu_memory_fraction) is one call: no row loop, and in
    the row orientation no pass but XLA's slices of q, k and v out of a projection it merged
    (which the packed projection read in place is to remove). With the CPU's 256 MiB budget
    (b512478) the MSA row module ran 64 rows of 128 residues as two tiles, assembled by a pad and
    a dynamic-update-slice of the whole update (at model_1's sizes: 2-3 while loops,
    benchmark_results/module_passes/)."""
    reason = targets.missing("h100")
    if reason:
        pytest.skip(f"cannot compile for h100: {reason}")
    cells = [
        dict(what="msa_row", mode="training", n_seq=64, n_res=128, target="h100"),
        dict(what="triangle_end", mode="inference", n_seq=1, n_res=128, target="h100"),
    ]
    rows = targets.in_child("gated_attention_tools.module_passes:compile_cells", dict(cells=cells))
    assert [r["loops"] for r in rows] == [0, 0], rows
    assert {op for op, _ in rows[0]["passes"]} <= {"fusion(slice)"}, rows[0]
