"""The hardware floor of a device benchmark cell: the time its exponentials, its matmuls and its
HBM traffic take at the device's peak rates, each alone; the floor is the largest of the three.

A measured time over the floor is how far a variant is from the hardware ("% of the floor" =
floor / time). The work per attention score s = B * N * T * S at head dim H (the device
benchmark's shapes: q, k, v [B, T, N, H], a bias [1, N, T, S] shared over the batch, a key mask):

  forward        s exponentials; 4 H s matmul FLOPs (Q K^T, P V); reads q, k, v, the bias once
                 and the mask, writes the output.
  training step  2 s exponentials (the backward rebuilds P once); 14 H s matmul FLOPs (the
                 forward's 4 H, the backward's Q K^T, dO V^T, P^T dO, dS K, dS^T Q: 10 H); the
                 forward's traffic, then reads q, k, v, the output, its cotangent and the bias
                 again and writes dq, dk, dv and the bias gradient.
  module level   adds the projections (q, k, v, gate and output: 5 of [T, C] x [C, C], C = N H,
                 3x the FLOPs in a training step) and reads q_data and writes the update.

The rates (../shared/research/gpu-anchors-2026-11.md): the exponential unit does 16 per SM per
clock; dense bfloat16 tensor cores 4,096 FLOP per SM per clock on Hopper, TF32 half that (float32
at the default precision); HBM as published. Where the device is not known the floor is None.
"""

from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    exp_per_s: float  # exponentials per second: 16 per SM per clock
    bf16_flops: float  # dense bfloat16/float16 matmul FLOP/s (float32 accumulation)
    tf32_flops: float  # dense TF32 matmul FLOP/s: float32 dots at the default precision
    hbm_bytes_per_s: float


_HOPPER = dict(
    exp_per_s=16 * 132 * 1.83e9,  # 3.87e12
    bf16_flops=4096 * 132 * 1.83e9,  # 989.5e12
    tf32_flops=2048 * 132 * 1.83e9,  # 494.7e12
)
DEVICES = (
    Device("H200", hbm_bytes_per_s=4.8e12, **_HOPPER),
    Device("H100", hbm_bytes_per_s=3.35e12, **_HOPPER),  # SXM (80 GB HBM3)
    Device(
        "B200",
        exp_per_s=16 * 148 * 1.86e9,
        bf16_flops=2.25e15,
        tf32_flops=1.125e15,
        hbm_bytes_per_s=8e12,
    ),
)


def device(kind: str) -> Device | None:
    """The Device named in a JAX device kind ('NVIDIA H100 80GB HBM3'), or None."""
    words = set(re.split(r"[\s_-]+", kind.upper()))
    return next((d for d in DEVICES if d.name in words), None)


@dataclasses.dataclass(frozen=True)
class Work:
    exps: float
    flops: float
    bytes: float


def work(shape: dict, dtype: str, mode: str, level: str = "op") -> Work:
    """The exponentials, matmul FLOPs and least HBM bytes of one call of a cell."""
    b, t, n, h = shape["batch"], shape["length"], shape["num_head"], shape["head_dim"]
    size = 4 if dtype == "float32" else 2
    scores = b * n * t * t
    act = b * t * n * h * size  # one of q, k, v, the output or a gradient of them
    bias = n * t * t * size if shape.get("bias", True) else 0
    mask = b * t if shape.get("mask", True) else 0
    training = mode == "forward_backward"
    exps = scores * (2 if training else 1)
    flops = scores * h * (14 if training else 4)
    traffic = 4 * act + bias + mask  # q, k, v in, the output out
    if training:
        traffic += (
            5 * act + bias + mask + 3 * act + bias
        )  # q, k, v, o, dO in; dq, dk, dv, dbias out
    if level == "module":
        c = n * h
        flops += 5 * 2 * b * t * c * c * (3 if training else 1)
        traffic += 2 * act * (2 if training else 1)  # q_data in, the update out (and their grads)
    return Work(exps, flops, traffic)


def floor(shape: dict, dtype: str, mode: str, kind: str, level: str = "op") -> dict | None:
    """{exp_ms, mma_ms, hbm_ms, floor_ms, bound} of a cell on the device kind, or None."""
    dev = device(kind)
    if dev is None:
        return None
    w = work(shape, dtype, mode, level)
    flops_per_s = dev.tf32_flops if dtype == "float32" else dev.bf16_flops
    times = dict(
        exp_ms=1e3 * w.exps / dev.exp_per_s,
        mma_ms=1e3 * w.flops / flops_per_s,
        hbm_ms=1e3 * w.bytes / dev.hbm_bytes_per_s,
    )
    bound = max(times, key=times.get)
    return dict(times, floor_ms=times[bound], bound=bound.removesuffix("_ms"))
