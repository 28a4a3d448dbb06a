"""The Pallas GPU kernels' tile table (gated_attention/attention/pallas_triton/tile_table.py and .json): the shipped
table is what gated_attention_tools/kernel_matrix/tile_table.py makes of the kernel matrices' results, it gives
every key the tiles the hand tables it replaced gave, the fields a user gives still win, and a key
it lacks gets the fallback."""

from __future__ import annotations

import copy
import hashlib
import itertools
import json

import jax.numpy as jnp
import pytest
from jax import lax

import gated_attention as ga
from gated_attention.attention.pallas_triton import tile_table as pallas_tiles
from gated_attention_tools.kernel_matrix import pallas_triton, tile_table

# Every key's tiles as the hand tables and their precedence gave them before the generated table
# (tile_table.UNRECORDED_* are those tables, as the results were compiled with them), frozen as
# a digest of the sorted (key, tiles) pairs: a change to any key's tiles fails here, so it is
# made on purpose, with the results regenerated. Changed on purpose once since: with the B200 among
# tile_table.TARGETS, 12 keys whose tiles spilled there took candidates clean on all three targets
# (benchmark_results/gpu_kernels/*_candidates.json; before: 9397f6b6...858355365f71).
FROZEN_TABLE_DIGEST = "4c6ce1efaa603887b53472ae3d782a06101c05568875de01578867fb94602796"
OLD_FALLBACK = (16, 16, 4, 1)
PRECISIONS = {"default": None, "high": lax.Precision.HIGH, "highest": lax.Precision.HIGHEST}
DTYPES = {"float32": jnp.float32, "half": jnp.bfloat16}


def old_keys():
    for kind in ("float32", "half"):
        for level in PRECISIONS if kind == "float32" else ("default",):
            yield from itertools.product(
                [kind], [level], (16, 32, 64, 128), (False, True), pallas_triton.BIASES,
                pallas_triton.MASKS,
            )  # fmt: skip


def generated():
    return tile_table.generate(tile_table.load_rows(tile_table.RESULTS.glob("*.json")))


def test_the_shipped_table_is_what_the_generator_makes_of_the_results():
    """A hand edit of pallas_tiles.json, or results it was not regenerated from, fails here:
    `python -m gated_attention_tools.kernel_matrix.tile_table` regenerates it."""
    assert tile_table.render(generated()) == pallas_tiles.TABLE_FILE.read_text()
    assert tile_table.main(["--check"]) == 0


def _digest(table) -> str:
    items = sorted((list(k), list(v)) for k, v in table.items())
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()


def _class(group):
    """The table's keys of a shared-memory class, without the class."""
    return {k[1:]: v for k, v in pallas_tiles.table().items() if k[0] == group}


def test_every_key_keeps_the_tiles_of_the_hand_tables():
    """The data-centre GPUs' class keeps its tiles; where no GPU is known (here) it is the one
    looked up."""
    expected = _class("large")
    assert set(expected) == set(old_keys())
    assert set(pallas_tiles.table()) == {(g, *k) for g in ("large", "small") for k in old_keys()}
    assert _digest(expected) == FROZEN_TABLE_DIGEST
    impl = ga.PallasAttention()
    for (kind, level, head_dim, options, bias, mask), tiles in expected.items():
        dtype, precision = DTYPES[kind], PRECISIONS[level]
        assert impl.tiles(dtype, precision, head_dim, options, (bias, mask)) == tiles
        # head dims pad to a power of two >= 16
        assert impl.tiles(dtype, precision, head_dim // 2 + 1, options, (bias, mask)) == tiles
    # a call that names no form: the heaviest's
    assert impl.tiles(jnp.float32, lax.Precision.HIGH, 32) == (16, 16, 8, 1)


def test_given_fields_override_the_table_and_missing_keys_get_the_fallback():
    form = ("shared", "key")
    table = pallas_tiles.lookup(jnp.float32, lax.Precision.HIGH, 16, False, form)
    assert table == (64, 16, 8, 1)
    impl = ga.PallasAttention(block_k=32, num_stages=3)
    assert impl.tiles(jnp.float32, lax.Precision.HIGH, 16, False, form) == (64, 32, 8, 3)
    given = ga.PallasAttention(block_q=16, block_k=16, num_warps=2, num_stages=1)
    assert given.tiles(jnp.float16, None, 128, True, form) == (16, 16, 2, 1)
    assert pallas_tiles.FALLBACK == OLD_FALLBACK
    assert ga.PallasAttention().tiles(jnp.float32, None, 256) == pallas_tiles.FALLBACK
    assert pallas_tiles.lookup(jnp.bfloat16, lax.Precision.HIGH, 64) == pallas_tiles.FALLBACK


def test_a_gpu_takes_the_class_of_its_shared_memory(monkeypatch):
    """The class comes from the GPU compiled for: its kind's compute capability, its opt-in shared
    memory per block; consumer GPUs (99 KiB) look up tiles that fit there, whose estimate
    (memory.gpu_shared_memory_bytes, the plan's check) is within 99 KiB."""
    from gated_attention.core import memory, platforms

    class Device:
        def __init__(self, kind):
            self.device_kind = kind

    for kind, capability, group in [
        ("NVIDIA H100 80GB HBM3", (9, 0), "large"),
        ("NVIDIA A100-SXM4-80GB", (8, 0), "large"),
        ("NVIDIA B200", (10, 0), "large"),
        ("NVIDIA GeForce RTX 4090", (8, 9), "small"),
        ("NVIDIA L4", (8, 9), "small"),
        ("NVIDIA RTX 6000 Ada Generation", (8, 9), "small"),
        ("NVIDIA A10G", (8, 6), "small"),
        ("NVIDIA GeForce RTX 5090", (12, 0), "small"),
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition", (12, 0), "small"),
        ("NVIDIA Unknown", None, "small"),  # a GPU of unknown capability: tiles that fit 99 KiB
    ]:
        monkeypatch.setattr(platforms, "_gpu", lambda kind=kind: Device(kind))
        assert platforms.gpu_capability() == capability, kind
        assert pallas_tiles.shared_memory_class() == group, kind
    monkeypatch.setattr(platforms, "_gpu", lambda: None)
    assert pallas_tiles.shared_memory_class() == "large"  # no GPU: the tiles as before classes
    assert pallas_tiles.shared_memory_class(101_376) == "small"
    assert pallas_tiles.shared_memory_class(232_448) == "large"
    with pytest.raises(ValueError, match="limit must be at least 101,376"):
        pallas_tiles.shared_memory_class(65_536)
    with pytest.raises(ValueError, match="shared_memory must be one of"):
        pallas_tiles.lookup(jnp.float32, None, 32, shared_memory="medium")
    # every small tile within 99 KiB by the plan's estimate for its key's operands (a bias of the
    # compute dtype per bias form, an int8 mask), so the plan never refuses the table's own tiles
    biases = dict(shared=1, per_row=1, both=2, none=0)
    for (kind, _, head_dim, _, bias, mask), (bq, bk, _, stages) in _class("small").items():
        item = 4 if kind == "float32" else 2
        need = memory.gpu_shared_memory_bytes(
            block_q=bq, block_k=bk, stages=stages, padded_head_dim=head_dim, itemsize=item,
            pair_itemsize=item * biases[bias] + (mask != "none"),
        )  # fmt: skip
        assert need <= pallas_tiles.SHARED_MEMORY_CLASSES["small"], (kind, head_dim, bias, mask)
    # which the data-centre tiles did not do everywhere (float32 H16, both biases: 108,134 B)
    assert _class("large")[("float32", "default", 16, False, "both", "key")] == (64, 64, 4, 2)
    assert _class("small")[("float32", "default", 16, False, "both", "key")] != (64, 64, 4, 2)


def _recorded(rows, key, tiles, spill=0, targets=tile_table.CLASSES["large"]):
    """Rows compiling every case of `key` with `tiles` (recorded), from the results' rows."""
    out = []
    for row in rows:
        if tile_table.case_key(row["case"]) == key and row["target"] in targets:
            row = copy.deepcopy(row)
            row["tiles"] = list(tiles)
            for kernel in row["kernels"].values():
                kernel["spill_store_bytes"] = spill
                if "threads" in kernel:
                    kernel["threads"] = 32 * tiles[2]
            out.append(row)
    return out


def test_the_rule_takes_the_largest_clean_tiles_then_the_nearest_clean_ones():
    rows = tile_table.load_rows(tile_table.RESULTS.glob("*.json"))
    heavy = ("float32", "default", 32, False, "both", "full")
    light = ("float32", "default", 32, False, "shared", "key")
    candidates = (
        _recorded(rows, heavy, (64, 64, 4, 2))  # larger than (32, 32, 4, 2): taken
        + _recorded(rows, heavy, (64, 64, 8, 2), spill=8)  # larger, but spills
        + _recorded(rows, light, (64, 64, 4, 2), spill=4)  # the heaviest's, but spills
        + _recorded(rows, light, (64, 64, 4, 1), targets=("a100",))  # one target only
        + _recorded(rows, light, (64, 32, 4, 2))  # one halving away
        + _recorded(rows, light, (64, 64, 8, 2))  # one field away, larger: taken
    )
    table = tile_table.generate(rows + candidates)
    assert table[("large", *heavy)] == (64, 64, 4, 2)
    assert table[("large", *light)] == (64, 64, 8, 2)
    unchanged = {
        k: v for k, v in generated().items() if k[0] != "large" or k[1:4] != heavy[:3] or k[4]
    }
    assert unchanged.items() <= table.items()
    # the further arguments' tiles (only the heaviest form is compiled) serve every form
    for group in tile_table.CLASSES:
        options = (group, "half", "default", 64, True)
        assert {
            table[(*options, *form)]
            for form in itertools.product(pallas_triton.BIASES, pallas_triton.MASKS)
        } == {table[(*options, *tile_table.HEAVIEST)]}
    # a class's tiles come from its own targets' rows: the large targets' candidates above
    # leave the small class's entry as it was
    assert table[("small", *heavy)] == generated()[("small", *heavy)]
    with pytest.raises(ValueError, match="no tile compiled clean"):
        tile_table.generate([r for r in rows if tile_table.case_key(r["case"]) != heavy])
    wrong = _recorded(rows, light, (64, 64, 8, 2))
    for row in wrong:
        row["tiles"][2] = 4
    with pytest.raises(ValueError, match="threads"):
        tile_table.generate(rows + wrong)


def test_an_exempt_key_is_clean_on_the_other_targets_and_its_entry_errs_once_a_tile_is_clean():
    """tile_table.EXEMPT lets a key off a target no candidate compiled clean on; a tile clean on
    every target makes the entry stale (an error), and without the entry the key has no tile."""
    rows = tile_table.load_rows(tile_table.RESULTS.glob("*.json"))
    table = generated()
    for key, targets in tile_table.EXEMPT.items():
        group = tile_table.CLASSES[key[0]]
        assert set(targets) < set(group)
        others = [t for t in group if t not in targets]
        assert _recorded(rows, key[1:], table[key], targets=others)  # compiled on the others
        clean = _recorded(rows, key[1:], (16, 16, 1, 1), targets=group)  # a tile never compiled
        for row in clean:
            row["problems"] = []
            for kernel in row["kernels"].values():
                kernel["spill_load_bytes"] = 0
        with pytest.raises(ValueError, match="EXEMPT"):
            tile_table.generate(rows + clean)
    if tile_table.EXEMPT:
        exempt = dict(tile_table.EXEMPT)
        try:
            tile_table.EXEMPT.clear()
            with pytest.raises(ValueError, match="no tile compiled clean"):
                tile_table.generate(rows)
        finally:
            tile_table.EXEMPT.update(exempt)
