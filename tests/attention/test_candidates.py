"""The tuning candidates (attention/candidates.py): what each GPU implementation offers a target,
their stable names, and every candidate an H100 takes at AF2's kernel form computing the float64
reference's attention and gradients in Pallas's interpreters."""

import dataclasses

import jax.numpy as jnp
import pytest

import gated_attention as ga
from gated_attention.attention import candidates
from gated_attention.attention.pallas_triton import tile_table as pallas_tiles
from tests import implementation_harness as harness

H100, A100, B200 = (9, 0), (8, 0), (10, 0)


def test_each_target_gets_what_it_can_take():
    # Ours (the peers' candidates: tests/attention/test_peers.py).
    ours = dict(implementations=candidates.OURS)
    names = lambda *a, **k: [c.name for c in candidates.for_target(*a, **(ours | k))]
    hopper = names(H100, "bfloat16", 32)
    # The defaults first, each tuning named with every field it sets.
    # Mosaic's: its default tiles one row a program, two rows (the shared bias's tiles loaded
    # once for both), then the other tile, then both tiles with two consumer warpgroups, last
    # the default tile's two consumers as a persistent forward.
    assert hopper[:7] == [
        "mosaic:bk128,r1", "mosaic:bk128,r2", "mosaic:bk64,r1", "mosaic:bk128,r1,c2",
        "mosaic:bk64,r1,c2", "mosaic:bk128,r1,c2,p1", "pallas:bq64,bk64,w4,s2,r2",
    ]  # fmt: skip
    assert hopper[-2:] == ["cudnn", "xla"] and len(hopper) == len(set(hopper)) == 18
    assert "pallas:bq64,bk64,w4,s3,r2" in hopper and "pallas:bq64,bk64,w4,s2,r1" in hopper
    # The Triton default with the one-pass backward, the only candidate that names that field.
    assert hopper[-3] == "pallas:bq64,bk64,w4,s2,r2,f1"
    assert [n for n in hopper if ",f" in n] == [hopper[-3]]
    # Mosaic on Hopper only; the Triton kernel's default there takes two rows a program.
    for other in (A100, B200):
        got = names(other, "bfloat16", 32)
        assert not any(n.startswith("mosaic") for n in got) and len(got) == 12
        assert got[0] == "pallas:bq64,bk64,w4,s2,r1" and got[-3] == got[0] + ",f1"
    # float32: no cuDNN, one Mosaic tile; the table's tiles for float32 at head dim 32.
    f32 = names(H100, "float32", 32)
    assert f32[:5] == [
        "mosaic:bk64,r1", "mosaic:bk64,r2", "mosaic:bk64,r1,c2", "mosaic:bk64,r1,c2,p1",
        "pallas:bq32,bk32,w4,s2,r1",
    ]  # fmt: skip
    assert "cudnn" not in f32
    assert not [n for n in f32 if ",f1" in n]  # the fused backward spills in float32 off Hopper
    # float32 at head dim 64: two rows' (or two consumers') tiles are over an H100 block's
    # shared memory; at head dim 32 with two pair biases two consumers' are (its compile: 233,616
    # B), one consumer's two rows are not.
    assert names(H100, "float32", 64, implementations=("mosaic",)) == ["mosaic:bk64,r1"]
    assert names(H100, "float32", 32, bias="both", implementations=("mosaic",)) == [
        "mosaic:bk64,r1", "mosaic:bk64,r2"
    ]  # fmt: skip
    assert pallas_tiles.lookup(jnp.float32, None, 32, False, ("shared", "key")) == (32, 32, 4, 2)
    # No bias, or one per row: no rows-a-program candidate (the rows share nothing).
    for bias in ("none", "per_row"):
        assert not any(n.endswith("r2") for n in names(H100, "bfloat16", 32, bias=bias))
    # Past the kernels' head dims (a mask: Mosaic's 64), only what takes them.
    assert names(H100, "bfloat16", 96)[0].startswith("pallas") and "xla" in names(
        H100, "float32", 256
    )


def test_the_pallas_defaults_are_what_the_instance_takes():
    """The first Triton candidate is the default instance's plan on that GPU for that form."""
    [first, *_] = ga.PallasAttention.candidates(H100, "bfloat16", 32, bias="shared", mask="key")
    sd = jnp.zeros
    q = sd((4, 384, 8, 32), jnp.bfloat16)
    bias, mask = sd((1, 8, 384, 384), jnp.bfloat16), sd((4, 1, 1, 384), bool)
    plan = ga.PallasAttention(interpret=True).plan(
        q, q, q, (bias,), mask, scale=1.0, compute_dtype=jnp.bfloat16
    )  # the interpreter plans as on Hopper
    assert first == dict(
        block_q=plan.block_q, block_k=plan.block_k, num_warps=plan.num_warps,
        num_stages=plan.num_stages, rows_per_program=plan.rows_per_program,
    )  # fmt: skip


def test_bad_candidates_are_refused():
    with pytest.raises(ValueError, match=r"implementation must be one of .*got 'chunked'"):
        candidates.candidate("chunked")
    with pytest.raises(
        ValueError,
        match=r"options of 'mosaic' must be fields of "
        r"\['block_k', 'consumer_warpgroups', 'persistent', 'rows_per_program'\]",
    ):
        candidates.candidate("mosaic", dict(block_q=64))
    with pytest.raises(TypeError, match="options must be a mapping of field to value, got list"):
        candidates.candidate("pallas", [("block_q", 64)])
    with pytest.raises(TypeError, match=r"capability must be a \(major, minor\) tuple, got 9"):
        candidates.for_target(9, "bfloat16", 32)
    with pytest.raises(ValueError, match="block_k must be 64 or 128, got 96"):
        candidates.candidate("mosaic", dict(block_k=96)).build()


def test_names_and_builds_are_stable():
    c = candidates.candidate("pallas", dict(rows_per_program=2, block_q=32))
    assert c.name == "pallas:bq32,r2" and c.as_dict() == dict(block_q=32, rows_per_program=2)
    built = c.build(interpret=True)
    assert built == ga.PallasAttention(block_q=32, rows_per_program=2, interpret=True)
    assert candidates.candidate("xla").build(interpret=True) == ga.XlaAttention()
    labels = [ga.PallasAttention.CANDIDATE_FIELDS, ga.MosaicAttention.CANDIDATE_FIELDS]
    for fields in labels:  # every label names a dataclass field, each label once
        assert len(set(fields.values())) == len(fields)
    assert set(labels[0]) <= {f.name for f in dataclasses.fields(ga.PallasAttention)}
    assert set(labels[1]) <= {f.name for f in dataclasses.fields(ga.MosaicAttention)}


# B, T, S, N, H, Hv. Triton: T = S = 72, so the largest candidate tile (128) is kept (Plan.make
# clamps to the length's power of two) and the last tile of 16 or 32 is partial; three rows (two
# a program leave one alone). Mosaic (keys a tile its one field; the interpreter runs each
# program through Python): one block of 64 queries, 72 keys in one tile of 128 or two of 64.
SHAPES = dict(pallas=(3, 72, 72, 1, 32, 32), mosaic=(2, 64, 72, 1, 32, 32))


@pytest.mark.parametrize("family", ["pallas", "mosaic"])
def test_every_h100_candidate_matches_the_reference(family):
    """AF2's form (a pair bias shared over the batch, a key mask), bfloat16, forward and vjp, of
    every candidate an H100 takes, interpreted, in one program, against the float64 reference."""
    found = [c for c in candidates.for_target(H100, "bfloat16", 32) if c.implementation == family]
    assert len(found) == {"pallas": 10, "mosaic": 6}[family]
    # Warps and pipeline stages are Triton's compiler's alone: candidates that differ only in
    # them are one program in the interpreter, run once for them all.
    compiled_only = {"num_warps", "num_stages"}
    same = lambda c: tuple((f, v) for f, v in c.options if f not in compiled_only)  # noqa: E731
    programs = {same(c): c for c in found}
    case, case64 = harness.problem(SHAPES[family], "bfloat16", "shared_bias+key_mask", seed=7)
    impls = tuple(c.build(interpret=True) for c in programs.values())
    results = dict(zip(programs, harness.run(impls, [case] * len(impls)), strict=True))
    [expected] = harness.reference_run([case64])
    for c in found:
        harness.assert_matches(results[same(c)], expected, "bfloat16", c.name)
