"""The peers' programs compiled for GPU targets in child processes (targets.in_child), for
tests/attention/test_peer_compiles.py: each returns plain data the test asserts on."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import gated_attention as ga
from gated_attention.attention import candidates, dispatch
from gated_attention.core import platforms
from gated_attention_tools import device_benchmark, targets


def compile_peers(target: str, dtype: str = "bfloat16") -> dict:
    """{member: {mode: 'compiled' or the error}} for every peer the sweep lists for `target`'s
    compute capability at AF2's kernel form (a shared bias, a key mask; head dim 32), each the
    forward and the training step (device_benchmark.op_step) compiled for the target. The
    target's device is the default one while tracing: tokamax reads its compute capability
    there (gpu_utils), as on the GPU itself."""
    device = targets.device(target)
    with targets.abstract_gpu(target):
        capability = platforms.gpu_capability()
    listed = [c.implementation for c in candidates.for_target(capability, dtype, 32)]
    shape = device_benchmark.OpShape("peers 2x128 h2x32", 2, 128, 2, 32)
    out = {}
    for name in (n for n in listed if n in dispatch.PEERS):
        out[name] = {}
        for mode in device_benchmark.MODES:
            args = device_benchmark.op_inputs(shape, dtype, mode)
            specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
            attend = lambda q, k, v, bias, mask, name=name: ga.dot_product_attention(
                q, k, v, bias, mask, implementation=name, compute_dtype="input"
            )
            try:
                with jax.default_device(device):
                    targets.compile(device_benchmark.op_step(attend, mode), *specs, target=target)
                out[name][mode] = "compiled"
            except Exception as e:  # the reason, for the test to judge
                out[name][mode] = f"{type(e).__name__}: {str(e)[:300]}"
    return dict(capability=list(capability), members=out, dtype=str(jnp.dtype(dtype)))
