"""The platforms JAX starts in this repository's scripts: the CPU alone on a machine without a GPU
or TPU.

With the `targets` extra installed (JAX's CUDA plugin and libtpu, for compiling for GPUs and TPUs
without one), JAX tries to start both backends on a plain CPU machine and prints their failures
(a CUDA traceback, libtpu's worker-hostname error). JAX_PLATFORMS=cpu starts the CPU alone and
keeps both plugins registered, so deviceless compiles work as before. Set JAX_PLATFORMS yourself to
choose otherwise; on a machine with a GPU or TPU nothing is changed.
"""

from __future__ import annotations

import glob
import os
import sys

# Device nodes of NVIDIA's driver, AMD's ROCm driver and TPU VMs (v4/v5p: accel, v5e/v6e: vfio).
_ACCELERATOR_NODES = (
    "/dev/nvidiactl",
    "/dev/nvidia0",
    "/dev/kfd",
    "/dev/accel*",
    "/dev/vfio/[0-9]*",
)


def accelerator_present(root: str = "") -> bool:
    """Whether the machine has a GPU or TPU device node (root: a prefix, for tests)."""
    return any(glob.glob(root + pattern) for pattern in _ACCELERATOR_NODES)


def cpu_unless_accelerator(root: str = "") -> str | None:
    """Sets JAX_PLATFORMS=cpu where it is unset and no accelerator is present; returns the value
    set, or None when nothing was changed. Call before JAX starts a backend."""
    if "JAX_PLATFORMS" in os.environ or accelerator_present(root):
        return None
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:  # imported already: its config read the environment at import
        sys.modules["jax"].config.update("jax_platforms", "cpu")
    return "cpu"
