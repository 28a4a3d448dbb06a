"""Deviceless compiles of the peers (peers.py) for an H100 and an A100: every member the sweep
lists for the GPU (candidates.for_target) compiled, forward and training step, by XLA's real GPU
compiler (tests/peer_target_cases.py, in a child process); what does not compile says why."""

import importlib.util

import pytest

from gated_attention.attention import dispatch
from gated_attention_tools import targets

HAS_TOKAMAX = importlib.util.find_spec("tokamax") is not None
BOTH = {"forward": "compiled", "forward_backward": "compiled"}


@pytest.mark.parametrize("target, capability", [("h100", [9, 0]), ("a100", [8, 0])])
def test_every_peer_the_sweep_lists_compiles_for_the_gpu(target, capability):
    reason = targets.missing(target)
    if reason:
        pytest.skip(f"cannot compile for {target}: {reason}")
    found = targets.in_child(
        "tests.peer_target_cases:compile_peers", dict(target=target), log=lambda line: None
    )
    assert found["capability"] == capability
    members = found["members"]
    assert tuple(members) == dispatch.PEERS  # the sweep lists every peer at bfloat16 there
    assert members["colabfold"] == members["colabfold_packed"] == BOTH
    tokamax = {n: m for n, m in members.items() if n.startswith("tokamax_")}
    if not HAS_TOKAMAX:
        for name, modes in tokamax.items():  # cuDNN's own refusal (checked first) or that
            for why in modes.values():
                assert "tokamax is not installed" in why or "needs the cuDNN library" in why, name
        return
    for name in ("tokamax_triton", "tokamax_xla_chunked", "tokamax_xla"):
        assert tokamax[name] == BOTH, name
    # Its Mosaic GPU backward is Hopper's and Blackwell's: the A100's training step is refused
    # (the sweep's row says so), its forward compiles (tokamax's sm_80 kernel).
    mosaic = tokamax["tokamax_mosaic"]
    assert mosaic["forward"] == "compiled"
    if target == "h100":
        assert mosaic["forward_backward"] == "compiled"
    else:
        assert "only supported for sm90 and sm100" in mosaic["forward_backward"]
    # cuDNN's library does not load without a GPU: refused (on the device it is timed).
    for why in tokamax["tokamax_cudnn"].values():
        assert "needs the cuDNN library, which JAX cannot load here" in why
