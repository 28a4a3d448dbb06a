"""The JAX this library needs, checked once at import: one clear error instead of a traceback from
inside JAX when an older release lacks what the library calls; and every private JAX symbol the
library touches, each behind one function here (tests/core/test_compat.py fails when JAX moves one).

Tested: jax 0.10.2 (Python 3.11, the release AlphaFold 3 pins) and the newest the registry serves
for Python 3.12 (0.12.0.1); setup.py states the range.
"""

from __future__ import annotations

import contextlib
import importlib
from types import ModuleType
from typing import Any

MIN_JAX = (0, 10)
# What the library uses from jax's top level that older releases lack (sharding.py and the op).
REQUIRED = ("typeof", "shard_map", "set_mesh", "make_mesh")


def _release(version: str) -> tuple[int, ...]:
    parts = []
    for part in version.split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit()) or "0"
        parts.append(int(digits))
    return tuple(parts)


# The Pallas modules the kernel families use, imported at `import gated_attention` (import_pallas).
PALLAS_MODULES = (
    "jax.experimental.pallas",
    "jax.experimental.pallas.tpu",
    "jax.experimental.pallas.mosaic_gpu",
    "jax.experimental.pallas.triton",
)


def import_pallas() -> None:
    """Imports PALLAS_MODULES now. jax 0.12's Pallas TPU module registers a trace-context setting
    at import (pallas_fuser_disable_nested_fuse): imported inside a user's first trace, it changes
    every jit cache key after it, and each function jitted before compiles again (AF2's second
    recycle compiled the whole model again). One a jax lacks is skipped here: the kernel that
    needs it raises ImportError on use (the Triton kernel's check gives it as its reason)."""
    for name in PALLAS_MODULES:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def check_jax(jax_module: ModuleType) -> None:
    """Raises ImportError naming the installed jax and what is missing, if it is too old."""
    version = getattr(jax_module, "__version__", "unknown")
    missing = [name for name in REQUIRED if not hasattr(jax_module, name)]
    if missing or _release(version)[:2] < MIN_JAX:
        raise ImportError(
            f"gated_attention needs jax >= {'.'.join(map(str, MIN_JAX))} (it uses "
            f"{', '.join('jax.' + n for n in REQUIRED)}); the installed jax is {version}"
            + (f", which lacks {', '.join('jax.' + n for n in missing)}" if missing else "")
            + ". Upgrade it: pip install -U 'jax>=0.10' 'jaxlib>=0.10'"
        )


def cudnn_version() -> int | None:
    """The cuDNN library's version where JAX can load it here, else None (no CUDA plugin, or one
    without cuDNN: a deviceless compile for a GPU cannot build a cuDNN attention there)."""
    from jax._src.lib import cuda_versions  # JAX's own check reads it; no public API does

    if cuda_versions is None:
        return None
    try:
        return int(cuda_versions.cudnn_get_version())
    except RuntimeError:  # the plugin is there, the library is not
        return None


def trace_context_state(name: str, default: Any, help: str):  # noqa: A002 (JAX's own name)
    """A thread-local JAX config State in jax.jit's trace context: jit traces anew when its value
    differs (af2_package's swap). jax._src.config.State: no public API makes one."""
    from jax._src import config as jax_config

    return jax_config.State(
        name=name,
        default=default,
        help=help,
        include_in_jit_key=True,
        include_in_trace_context=True,
    )


class TracedSwap(contextlib.ContextDecorator):
    """A swap active in the entering thread while entered (re-entrant), seen by jax.jit: each
    entry registers what it swaps in `registry` under a key that names it and enters `state` (a
    trace_context_state) at that key, so a jit trace is served to the same swap only. Subclasses
    compute the key and what it swaps in __enter__ and call _activate (af2_package's, af3's)."""

    def __init__(self, state, registry: dict):
        import threading

        self._state, self._registry = state, registry
        self._entered = threading.local()  # this thread's open entries

    def _activate(self, key: str, swapped: Any) -> None:
        self._registry[key] = swapped
        entry = self._state(key)
        entry.__enter__()
        self._stack().append(entry)

    def __exit__(self, *exc) -> None:
        self._stack().pop().__exit__(*exc)

    def _stack(self) -> list:
        if not hasattr(self._entered, "stack"):
            self._entered.stack = []
        return self._entered.stack


def registered_backends() -> set[str]:
    """The platforms whose backend factories JAX registered (plugins included, started or not):
    jax._src.xla_bridge._backend_factories, which no public API lists."""
    from jax._src import xla_bridge

    return set(xla_bridge._backend_factories)


def triton_registration():
    """Pallas's Triton lowering registration module (imports it: an ImportError where this JAX
    has no Triton backend). jax._src.pallas.triton.pallas_call_registration."""
    return importlib.import_module("jax._src.pallas.triton.pallas_call_registration")


def mosaic_gpu_interpret_params(plgpu: ModuleType):
    """The Mosaic GPU interpreter's parameters class: public from jax 0.11 on, private in 0.10
    (jax._src.pallas.mosaic_gpu.interpret.params)."""
    params = getattr(plgpu, "InterpretGPUParams", None)
    if params is None:  # jax 0.10
        from jax._src.pallas.mosaic_gpu.interpret import params as module

        params = module.InterpretGPUParams
    return params


def named_barrier(plgpu: ModuleType, action: str, barrier: int, threads: int) -> None:
    """`bar.{action} barrier, threads;` (action 'sync' or 'arrive': a hardware named barrier of
    `threads` threads) inside a Mosaic GPU kernel: Pallas exposes none, so inline PTX through
    plgpu.inline_mgpu; the MLIR builders are jax._src.lib.mlir's (no public API)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm

    @plgpu.inline_mgpu()
    def op(_):
        void = ir.Type.parse("!llvm.void")
        ptx = f"bar.{action} {barrier}, {threads};"
        llvm.inline_asm(void, [], ptx, "", has_side_effects=True)

    op()
