"""The platform a program is compiled for, and choices made per platform.

JAX picks the platform late: a program traced on a CPU host may be compiled for a GPU or a TPU
(ahead-of-time `.lower()` with a device's or a topology's shardings), and nothing inside the trace
says which. So the op decides for every platform the program could be compiled for here and
stages the decisions with lax.platform_dependent, whose untaken branches XLA never lowers: a
program compiled for an H100 from a CPU host chooses exactly as on the H100.

Platform kinds are 'cpu', 'gpu' (CUDA or ROCm) and 'tpu', as jax.default_backend() names them.
"""

from __future__ import annotations

import contextvars
import functools
import importlib.util
import re
from collections.abc import Callable, Mapping

import jax

from gated_attention.core import compat

KINDS = ("cpu", "gpu", "tpu")
_LOWERING_NAMES = {"cpu": ("cpu",), "gpu": ("cuda", "rocm"), "tpu": ("tpu",)}


def kind(platform: str) -> str:
    """'cpu', 'gpu' or 'tpu' for a JAX platform or backend name ('cuda', 'rocm', 'gpu', ...)."""
    return "gpu" if platform in ("cuda", "rocm", "gpu") else platform


def host() -> str:
    """The kind of the default backend: where un-annotated programs run."""
    return kind(jax.default_backend())


# Compute capabilities by device kind, for a deviceless compile's abstract device (which names its
# kind only): the data-centre GPUs, then consumer and workstation Ampere, Ada and Blackwell (a
# name of several words matches those words in a row). First match wins: "RTX PRO 6000" (sm_120)
# before "Ada" ("RTX 6000 Ada Generation", sm_89).
_CAPABILITIES = (("H100", (9, 0)), ("H200", (9, 0)), ("H800", (9, 0)), ("GH200", (9, 0)),
                 ("B200", (10, 0)), ("B100", (10, 0)), ("GB200", (10, 0)), ("B300", (10, 3)),
                 ("GB300", (10, 3)), ("A100", (8, 0)), ("A800", (8, 0)), ("A30", (8, 0)),
                 ("A10", (8, 6)), ("A10G", (8, 6)), ("A40", (8, 6)), ("RTX A6000", (8, 6)),
                 ("RTX A5000", (8, 6)), ("RTX A4000", (8, 6)), ("3090", (8, 6)), ("3080", (8, 6)),
                 ("3070", (8, 6)), ("3060", (8, 6)), ("L4", (8, 9)), ("L40", (8, 9)),
                 ("L40S", (8, 9)), ("4090", (8, 9)), ("4080", (8, 9)), ("4070", (8, 9)),
                 ("4060", (8, 9)), ("RTX PRO 6000", (12, 0)), ("RTX PRO 5000", (12, 0)),
                 ("RTX PRO 4000", (12, 0)), ("5090", (12, 0)), ("5080", (12, 0)), ("5070", (12, 0)),
                 ("5060", (12, 0)), ("GB10", (12, 1)), ("Ada", (8, 9)))  # fmt: skip


def _named(kind: str, table):
    """The value of the first (name, value) of `table` whose name's words are in the device
    kind's words (in a row), else None."""
    words = " " + " ".join(kind.replace("-", " ").split()) + " "
    return next((value for name, value in table if f" {name} " in words), None)


def _gpu():
    """The GPU a program is being compiled for: the abstract mesh's device where one is in use
    (deviceless compiles), else the first GPU; None when there is none."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    if device is None:
        try:
            device = jax.devices("gpu")[0]
        except RuntimeError:  # no GPU backend
            return None
    return device


def gpu_kind() -> str | None:
    """The device kind of the GPU a program is being compiled for ('NVIDIA H100 80GB HBM3')."""
    device = _gpu()
    return None if device is None else str(getattr(device, "device_kind", "")) or None


def gpu_capability() -> tuple[int, int] | None:
    """(major, minor) compute capability of the GPU a program is being compiled for (_gpu);
    None when there is no GPU or its kind is not known."""
    device = _gpu()
    if device is None:
        return None
    capability = getattr(device, "compute_capability", None)
    if capability:
        return tuple(int(x) for x in str(capability).split(".")[:2])
    return _named(str(getattr(device, "device_kind", "")), _CAPABILITIES)


HOPPER = 9  # sm_90's major: wgmma (Blackwell, sm_100, has tcgen05 instead)


def gpu_is_hopper() -> bool:
    """Whether the GPU a program is being compiled for is a Hopper (sm_90: an H100 or H200)."""
    capability = gpu_capability()
    return capability is not None and capability[0] == HOPPER


# Streaming multiprocessors of the Hopper GPUs by kind, where a device does not say (core_count).
_CORE_COUNTS = (("H100 PCIe", 114), ("H100 NVL", 132), ("H100", 132), ("H200", 132),
                ("H800", 132), ("GH200", 132))  # fmt: skip
CORE_COUNT_FALLBACK = 132  # an H100 SXM's: what the Mosaic GPU kernels are tuned for


def gpu_core_count() -> int:
    """The streaming multiprocessors of the GPU a program is being compiled for: its core_count
    (a real device's or a deviceless compile's abstract one), else its kind's, else
    CORE_COUNT_FALLBACK (no GPU: the interpreter's)."""
    device = _gpu()
    if device is None:
        return CORE_COUNT_FALLBACK
    count = getattr(device, "core_count", None)
    if count:
        return int(count)
    found = _named(str(getattr(device, "device_kind", "")), _CORE_COUNTS)
    return CORE_COUNT_FALLBACK if found is None else found


# Opt-in shared memory per block by compute capability, bytes: the target configs'
# (gated_attention_tools/target_configs/) and XLA's published ones for sm_86 (RTX A6000) and
# sm_103 (B300); sm_87 (Jetson Orin) as the A100 in CUDA's table of compute capabilities.
_SHARED_MEMORY_PER_BLOCK = {(8, 0): 166_912, (8, 6): 101_376, (8, 7): 166_912, (8, 9): 101_376,
                            (9, 0): 232_448, (10, 0): 232_448, (10, 3): 232_448,
                            (12, 0): 101_376, (12, 1): 101_376}  # fmt: skip


def gpu_shared_memory_per_block() -> int | None:
    """The opt-in shared memory per block of the GPU a program is being compiled for, bytes:
    None when there is no GPU, else shared_memory_per_block of its capability."""
    if _gpu() is None:
        return None
    return shared_memory_per_block(gpu_capability())


def shared_memory_per_block(capability: tuple[int, int] | None) -> int:
    """The opt-in shared memory per block of a GPU of this (major, minor) capability, bytes: the
    smallest of the known capabilities' (101,376: what fits there fits on every GPU of the table)
    when it is not known."""
    found = _SHARED_MEMORY_PER_BLOCK.get(capability)
    return min(_SHARED_MEMORY_PER_BLOCK.values()) if found is None else found


# Memory of GPUs whose device kind names none ('NVIDIA H200'), in GB: what a deviceless compile's
# abstract device (no memory_stats) is known by. Kinds that name it ('... 80GB ...') are read.
_MEMORY_GB = (("GH200", 96), ("H200", 141), ("B200", 180), ("B100", 180), ("B300", 268),
              ("L40S", 48), ("L40", 48), ("L4", 24), ("A10", 24), ("4090", 24), ("5090", 32),
              ("RTX PRO 6000", 96))  # fmt: skip


def gpu_memory_bytes() -> int | None:
    """The memory of the GPU a program is being compiled for: what XLA's allocator may use on a
    real device (memory_stats' bytes_limit), else the memory its kind names or is known by; None
    when there is no GPU or it is not known."""
    device = _gpu()
    if device is None:
        return None
    stats = getattr(device, "memory_stats", None)
    stats = stats() if callable(stats) else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    kind = str(getattr(device, "device_kind", ""))
    named = re.search(r"(\d+)\s*GB", kind)
    if named:
        return int(named.group(1)) * 10**9
    gb = _named(kind, _MEMORY_GB)
    return None if gb is None else gb * 10**9


def of_arrays(arrays) -> str | None:
    """The kind of the devices holding these concrete arrays, if they agree; None when any is a
    tracer or not a jax.Array (under jit the devices are not known while tracing)."""
    kinds = set()
    for x in jax.tree.leaves(arrays):
        if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
            return None
        kinds.update(kind(d.platform) for d in x.devices())
    return kinds.pop() if len(kinds) == 1 else None


@functools.cache
def compilable() -> tuple[str, ...]:
    """Kinds this process can compile for: the host's, a GPU where JAX's CUDA or ROCm plugin is
    registered, a TPU where libtpu is installed (deviceless compiles need exactly these)."""
    found = [host()]  # first: starting the backends registers the plugins' factories
    registered = compat.registered_backends()
    if registered & {"cuda", "rocm"}:
        found.append("gpu")
    if importlib.util.find_spec("libtpu") is not None:
        found.append("tpu")
    return tuple(k for k in KINDS if k in found)


# The kinds the branch being traced serves, inside dispatch: code traced there (the op inside a
# module's branch) decides for them alone instead of staging every kind again.
_STAGED: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar(
    "gated_attention_staged_platforms", default=None
)


def candidates(arrays) -> tuple[str, ...]:
    """The kinds a call on these inputs may be compiled for, the likeliest first: the arrays' own
    when they are concrete, else those of the dispatch branch being traced, else the host's and
    then every other kind compilable here."""
    known = of_arrays(arrays)
    if known is not None:
        return (known,)
    staged = _STAGED.get()
    if staged is not None:
        return staged
    first = host()
    return (first, *(k for k in compilable() if k != first))


def dispatch(branches: Mapping[str, Callable], *args):
    """branches[kind](*args) for the kind the program is compiled for.

    One branch (or the same callable for every kind) is simply called; otherwise the branches are
    staged with lax.platform_dependent, the host's branch (where there is one) the default for
    any other platform. A branch is traced with candidates() answering the kinds it serves.
    """
    fns = list(dict.fromkeys(branches.values()))
    if len(fns) == 1:
        return fns[0](*args)
    served = {fn: tuple(k for k, f in branches.items() if f is fn) for fn in fns}
    staged = {fn: _traced_for(fn, kinds) for fn, kinds in served.items()}
    default = branches.get(host())  # None: lowering for a kind without a branch fails in JAX
    per_platform = {
        name: staged[fn] for k, fn in branches.items() if k != host() for name in _LOWERING_NAMES[k]
    }
    return jax.lax.platform_dependent(
        *args, default=None if default is None else staged[default], **per_platform
    )


def by_platform(decide: Callable[[str], object], build: Callable[[object], Callable], *args):
    """build(decide(kind))(*args) for the kind the program is compiled for: decided for every kind
    it may be compiled for (candidates), the kinds that decide alike sharing one traced branch."""
    decisions = {kind: decide(kind) for kind in candidates(args)}
    built = {d: build(d) for d in dict.fromkeys(decisions.values())}
    return dispatch({kind: built[d] for kind, d in decisions.items()}, *args)


def _traced_for(fn: Callable, kinds: tuple[str, ...]) -> Callable:
    def branch(*args):
        token = _STAGED.set(kinds)
        try:
            return fn(*args)
        finally:
            _STAGED.reset(token)

    return branch
