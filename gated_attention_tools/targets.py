"""Compiling for GPUs and TPUs on a machine that has neither: XLA's real compilers, deviceless.

A target is a GPU (a GpuTargetConfigProto in target_configs/, compiled by JAX's CUDA plugin, ptxas
included) or a TPU topology (compiled by libtpu). `spec(shape, dtype, target)` places an abstract
argument on the target's device, so `jax.jit(f).lower(*specs).compile()` compiles for it, and the
library's dispatch (gated_attention/core/platforms.py) chooses as it would on that device. Nothing runs:
compiles give device memory (memory_analysis), registers, spills and shared memory / VMEM, never
time.

Needs the `targets` extra (`pip install -e '.[targets]'`: JAX's CUDA plugin and PJRT at the
installed jax's version, nvidia-cuda-nvcc-cu12 for ptxas, libtpu) and JAX_PLATFORMS=cpu set
before jax starts (without it the CUDA plugin fails its driver check and never registers).
`missing(target)` says what is absent. Compile each case in a child process (`in_child`): libtpu
has crashed on some programs, and a crash must fail one case, not the caller.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
from pathlib import Path
from typing import Any

from gated_attention_tools import child, measure

CONFIG_DIR = Path(__file__).with_name("target_configs")
# Set in every child: the CUDA plugin then skips its driver check, libtpu its metadata queries.
CHILD_ENV = {
    "JAX_PLATFORMS": "cpu",
    "TPU_SKIP_MDS_QUERY": "1",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "TPU_ACCELERATOR_TYPE": "v5litepod-1",
    # Several processes may compile for a TPU at once (test workers): libtpu otherwise takes
    # /tmp/libtpu_lockfile and a second process fails.
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}


@dataclasses.dataclass(frozen=True)
class Target:
    """One compile target.

    Attributes:
      name: the key in TARGETS.
      kind: 'gpu' or 'tpu' (gated_attention.core.platforms kinds).
      memory_bytes: the device's memory (HBM), for "does it fit".
      arch: the GPU's ptxas architecture ('sm_90a'), or '' for a TPU.
      config: a GPU target config file name in CONFIG_DIR.
      topology: a TPU topology name for get_topology_desc, with its keyword arguments.
      shared_memory_bytes: a GPU's opt-in shared memory per block; a TPU's default scoped VMEM.
    """

    name: str
    kind: str
    memory_bytes: int
    shared_memory_bytes: int
    arch: str = ""
    config: str = ""
    topology: str = ""
    topology_kwargs: tuple = ()


GIB = 2**30
TARGETS = {
    t.name: t
    for t in (
        Target("h100", "gpu", 80 * GIB, 232_448, arch="sm_90a", config="h100_sxm.txtpb"),
        Target("a100", "gpu", 80 * GIB, 166_912, arch="sm_80", config="a100_sxm_80.txtpb"),
        # A 24 GB GPU (AlphaFold 3's users on consumer cards): the config's device_memory_size.
        Target("rtx4090", "gpu", 25_757_220_864, 101_376, arch="sm_89", config="rtx4090.txtpb"),
        # Memory and opt-in shared memory per block: the config's device_memory_size and
        # shared_memory_per_block_optin (178.4 GiB; the same 227 KiB as the H100).
        Target("b200", "gpu", 191_514_411_008, 232_448, arch="sm_100a", config="b200.txtpb"),
        # Consumer and workstation Blackwell (sm_120: RTX 50, RTX PRO 6000): XLA's published
        # config's device_memory_size (96 GiB) and opt-in shared memory per block (99 KiB).
        Target(
            "rtx6000pro", "gpu", 103_079_215_104, 101_376, arch="sm_120", config="rtx6000pro.txtpb"
        ),
        Target(
            "v5e",
            "tpu",
            16 * GIB,
            16 * 2**20,
            topology="v5e:1x1",
            topology_kwargs=(("chips_per_host_bounds", (1, 1, 1)),),
        ),
        Target(
            "v5p",
            "tpu",
            95 * GIB,
            16 * 2**20,
            topology="v5p:1x1x1",
            topology_kwargs=(("chips_per_host_bounds", (1, 1, 1)),),
        ),
        Target(
            "v6e",
            "tpu",
            32 * GIB,
            32 * 2**20,
            topology="v6e:1x1",
            topology_kwargs=(("chips_per_host_bounds", (1, 1, 1)),),
        ),
    )
}


def target(name: str) -> Target:
    if name not in TARGETS:
        raise ValueError(f"target must be one of {tuple(TARGETS)}, got {name!r}")
    return TARGETS[name]


def missing(name: str) -> str | None:
    """What is not installed for compiling for the target, or None (a GPU compile also needs
    JAX_PLATFORMS=cpu before jax starts, which in_child's processes have)."""
    t = target(name)
    hint = "install the targets extra: pip install -e '.[targets]'"
    if t.kind == "tpu":
        if not installed("libtpu"):
            return f"libtpu is not installed ({hint})"
        return None
    if not installed("jax_plugins.xla_cuda12"):
        return f"JAX's CUDA plugin is not installed ({hint})"
    if ptxas() is None:
        return f"ptxas (nvidia-cuda-nvcc-cu12) is not installed ({hint})"
    return None


def installed(module: str) -> bool:
    """Whether `module` is importable, without importing it (find_spec of a submodule raises
    when its parent package is missing: jax_plugins without JAX's CUDA plugin)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def ptxas() -> str | None:
    """The path of ptxas from the nvidia-cuda-nvcc-cu12 wheel, or None."""
    spec = importlib.util.find_spec("nvidia.cuda_nvcc") if installed("nvidia.cuda_nvcc") else None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "bin" / "ptxas"
    return str(path) if path.exists() else None


@functools.cache
def device(name: str):
    """The target's (abstract) device: arrays placed on it compile for the target."""
    from jax.experimental import topologies

    t = target(name)
    reason = missing(name)
    if reason is None and t.kind == "gpu" and os.environ.get("JAX_PLATFORMS") != "cpu":
        reason = "JAX_PLATFORMS=cpu must be set before jax starts (in_child does)"
    if reason:
        raise RuntimeError(f"cannot compile for {name}: {reason}")
    if t.kind == "gpu":
        config = (CONFIG_DIR / t.config).read_text()
        topo = topologies.get_topology_desc(platform="cuda", target_config=config, topology="1x1x1")
    else:
        topo = topologies.get_topology_desc(
            topology_name=t.topology, platform="tpu", **dict(t.topology_kwargs)
        )
    return topo.devices[0]


# Topologies of several devices per target kind: 8 GPUs in one host, a v5p slice of 8 chips.
MESH_TOPOLOGIES = {
    ("gpu", 8): dict(topology="1x1x8"),
    ("gpu", 64): dict(topology="1x8x8"),
    ("tpu", 8): dict(topology_name="{generation}:2x2x2", chips_per_host_bounds=(2, 2, 1)),
    ("tpu", 64): dict(topology_name="{generation}:4x4x4", chips_per_host_bounds=(2, 2, 1)),
}


def mesh(name: str, shape: tuple[int, ...], axis_names: tuple[str, ...], axis_type=None):
    """A mesh of math.prod(shape) abstract devices of the target (MESH_TOPOLOGIES: 8 or 64), for
    deviceless compiles of sharded programs: memory_analysis is then per device, and the compiled
    text lists the collectives. axis_type: a jax.sharding.AxisType for every axis (None: Explicit,
    jax.make_mesh's default)."""
    import math

    import jax
    import numpy as np
    from jax.experimental import topologies

    t = target(name)
    count = math.prod(shape)
    if (t.kind, count) not in MESH_TOPOLOGIES:
        raise ValueError(
            f"a mesh for {name} has {sorted(n for k, n in MESH_TOPOLOGIES if k == t.kind)} devices, "
            f"got shape {shape}"
        )
    device(name)  # the checks: installed, JAX_PLATFORMS=cpu
    kwargs = dict(MESH_TOPOLOGIES[t.kind, count])
    if t.kind == "gpu":
        topo = topologies.get_topology_desc(
            platform="cuda", target_config=(CONFIG_DIR / t.config).read_text(), **kwargs
        )
    else:
        generation = t.topology.split(":")[0]
        kwargs["topology_name"] = kwargs["topology_name"].format(generation=generation)
        topo = topologies.get_topology_desc(platform="tpu", **kwargs)
    types = (jax.sharding.AxisType.Explicit if axis_type is None else axis_type,) * len(shape)
    devices = np.array(topo.devices[:count]).reshape(shape)
    return jax.sharding.Mesh(devices, axis_names, axis_types=types)


def collectives(compiled) -> dict[str, list[str]]:
    """The collectives of a compiled program: {kind: [the result shape of each]}."""
    import re

    kinds = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")
    found = {k: [] for k in kinds}
    for line in compiled.as_text().splitlines():
        for kind in kinds:
            match = re.search(rf"= (.*?) {kind}(-start)?\(", line)
            if match:
                found[kind].append(match.group(1))
    return found


_ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2, "pred": 1, "s32": 4, "u32": 4, "f64": 8}


def result_bytes(shape: str) -> int:
    """Bytes of an HLO result type such as 'bf16[8,4,2048,2048]{...}' (a tuple: its largest)."""
    import math
    import re

    parts = re.findall(r"([a-z]+\d*)\[([\d,]*)\]", shape)
    return max(
        (
            _ITEMSIZE.get(t, 4) * math.prod(int(d) for d in dims.split(",") if d)
            for t, dims in parts
        ),
        default=0,
    )


def largest_gather(found: dict[str, list[str]]) -> int:
    """Bytes of the largest all-gather's result among collectives()' findings (0: none)."""
    return max((result_bytes(s) for s in found["all-gather"]), default=0)


def spec(shape, dtype, name: str):
    """An abstract argument of this shape and dtype on the target's device."""
    import jax

    return jax.ShapeDtypeStruct(
        tuple(shape), dtype, sharding=jax.sharding.SingleDeviceSharding(device(name))
    )


def on_target(tree, name: str):
    """Every array or ShapeDtypeStruct leaf of `tree` as an abstract argument on the target."""
    import jax

    return jax.tree.map(lambda x: spec(x.shape, x.dtype, name), tree)


def abstract_gpu(target: str):
    """A context in which the target GPU is the abstract mesh's device: jax >= 0.12 lowers
    Pallas's Triton calls for its compute capability, Mosaic GPU and platforms.gpu_capability
    read it; a deviceless compile has no other device to ask."""
    import jax

    d = device(target)
    gpu = jax.sharding.AbstractDevice(
        device_kind=d.device_kind, num_cores=d.core_count, platform="cuda"
    )
    # Auto, not jax 0.12's default Explicit: an Explicit axis would type every array in the
    # program as sharded over it, and a row loop's buffers would then disagree with its tiles.
    auto = (jax.sharding.AxisType.Auto,)
    return jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((1,), ("device",), axis_types=auto, abstract_device=gpu)
    )


def compile(fn, *args, target: str, dump_to: str | None = None, static: dict | None = None):  # noqa: A001
    """jax.jit(fn) compiled for the target at these abstract args (moved onto its device);
    `dump_to` a directory for XLA's dumps (the .ptx files of a GPU compile)."""
    import jax

    args = on_target(args, target)
    jitted = jax.jit(functools.partial(fn, **(static or {})))
    if TARGETS[target].kind == "gpu":
        with abstract_gpu(target):
            lowered = jitted.trace(*args).lower()
    else:
        lowered = jitted.lower(*args)
    options = {"xla_dump_to": dump_to} if dump_to else None
    return lowered.compile(options) if options else lowered.compile()


# Device memory of a compiled program, bytes: argument, output, temp, alias and peak (arguments +
# outputs + temporaries - aliased: what must fit at once). measure.py's reader, named here too.
memory = measure.compiled_memory


def in_child(
    function: str, kwargs: dict[str, Any], log=lambda line: None, env: dict | None = None
) -> Any:
    """function(**kwargs) ('module:function') in a fresh process set up for deviceless compiles
    (child.call with CHILD_ENV, and `env`, over this process's environment), so that a compiler
    crash fails only this call (RuntimeError)."""
    return child.call(function, kwargs, log, env={**CHILD_ENV, **(env or {})})


def search_longest(measure_at, start: int, step: int) -> list[dict]:
    """Rows measure_at(n) from `start` up (while they fit) or down (while they don't) in `step`s,
    each with a 'fits' key: the last fitting one is the longest that fits, to `step`."""
    rows = [measure_at(start)]
    direction = step if rows[0]["fits"] else -step
    while start + direction > 0:
        start += direction
        rows.append(measure_at(start))
        if rows[-1]["fits"] != rows[-2]["fits"]:
            break
    return rows
