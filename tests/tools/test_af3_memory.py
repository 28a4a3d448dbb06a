"""gated_attention_tools.af3_memory: its problems trace (abstractly: nothing compiles) for each
variant with the attention each says, and its table reads the rows its cells write."""

from __future__ import annotations

import jax
import pytest

import gated_attention as ga
from gated_attention_tools import af3_memory
from tests.af3 import af3_modules


@pytest.mark.parametrize(
    "variant, mode, what, ours",
    [
        ("af3", "gradient", "trunk", False),
        ("ours", "gradient", "trunk", True),
        ("floor_qkv", "gradient", "trunk", False),
        ("no_inline", "inference", "trunk", False),
        ("af3", "inference", "diffusion", False),
    ],
)
def test_problems_trace_with_their_attention(variant, mode, what, ours):
    af3_modules.load()
    fn, args = af3_memory.problem(variant, 16, mode, what)
    with ga.record_implementation_choices() as record:
        out = jax.eval_shape(fn, *args)
    assert bool(record) == ours, (variant, len(record))
    if mode == "gradient":
        assert out.shape == args[1].shape  # the pair's gradient


@pytest.mark.parametrize("variant, ours", [("af3", False), ("ours", True)])
def test_trunk_stack_is_af3s_48_checkpointed_blocks(variant, ours):
    af3_modules.load()
    fn, args = af3_memory.problem(variant, 16, "gradient", "trunk_stack")
    assert {leaf.shape[0] for leaf in jax.tree.leaves(args[0])} == {48}  # one layer per block
    with ga.record_implementation_choices() as record:
        jaxpr = str(jax.make_jaxpr(fn)(*args))
    assert bool(record) == ours, (variant, len(record))
    assert "scan" in jaxpr and "remat" in jaxpr  # AF3's layer stack, each block checkpointed


def test_unknown_variants_and_modes_are_refused():
    with pytest.raises(ValueError, match=r"variant must be one of .*'af3:<name>'"):
        af3_memory._swap("af3:flash")
    with pytest.raises(ValueError, match="what must be one of"):
        af3_memory.problem("af3", 16, "inference", "confidence")


def test_table_lists_cells_and_the_longest_that_fits():
    row = lambda n, fits: dict(  # noqa: E731
        variant="ours", n_tokens=n, mode="gradient", target="rtx4090", what="trunk",
        memory=dict(peak=int(n * 1e7)), chosen=["pallas"], fits=fits,
    )  # fmt: skip
    text = af3_memory.table([row(1280, True), row(1344, True), row(1408, False)])
    assert "| rtx4090 | trunk | gradient | ours | 1344 | 13.44 | yes | pallas |" in text
    assert "| rtx4090 (25.8 GB) | trunk | gradient | ours | 1344 | 1408 |" in text


def test_tokamax_cross_compiles_for_a_gpu_target_only():
    """AF3's 'triton' is tokamax's, which refuses a host without a GPU unless told it is
    compiling for one: the cells of a GPU target tell it, the others do not."""
    af3_modules.load()
    tokamax = pytest.importorskip("tokamax")
    assert not tokamax.config.cross_compile.value
    with af3_memory._cross_compiling("gpu"):
        assert tokamax.config.cross_compile.value
    with af3_memory._cross_compiling("tpu"):
        assert not tokamax.config.cross_compile.value
    assert not tokamax.config.cross_compile.value


def test_a_failed_cells_reason_is_its_own_last_line():
    error = (
        "Traceback (most recent call last):\n  ...\nRuntimeError: cuDNN not found.\n"
        "--------------------\nFor simplicity, JAX has removed its internal frames from the "
        "traceback of the following exception. Set JAX_TRACEBACK_FILTERING=off to include these."
    )
    assert af3_memory._reason(error) == "RuntimeError: cuDNN not found."
