"""The op's choice of implementation: the registry, 'auto' and its rules, priority lists, and
the record of what was chosen.

`implementation` accepts a name from IMPLEMENTATIONS, an implementation instance (carrying its own
tuning, e.g. ChunkedAttention(query_chunk_size=256)), a priority sequence of those (the first that
takes the inputs runs), or None / 'auto' / an `Auto` instance (rules below). A single named
implementation never falls back: it raises NotImplementedError saying why it cannot run. Each
implementation is asked once per call for its plan (base.Implementation.plan: the plan, or a
refusal with its reason), and the chosen one runs with that plan.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import types
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

from gated_attention.attention import base, peers
from gated_attention.attention.cudnn import CudnnAttention
from gated_attention.attention.pallas_mosaic_gpu.implementation import MosaicAttention
from gated_attention.attention.pallas_mosaic_tpu.implementation import PallasTpuAttention
from gated_attention.attention.pallas_triton.implementation import PallasAttention
from gated_attention.attention.peers import ColabFoldAttention, TokamaxAttention
from gated_attention.attention.per_mode import measured
from gated_attention.attention.xla import XlaAttention
from gated_attention.attention.xla_chunked.implementation import ChunkedAttention
from gated_attention.core import checks, memory, numerics, platforms

IMPLEMENTATIONS: types.MappingProxyType[str, base.Implementation] = types.MappingProxyType(
    {
        "xla": XlaAttention(),
        "chunked": ChunkedAttention(),
        "cudnn": CudnnAttention(),
        "mosaic": MosaicAttention(),
        "pallas": PallasAttention(),
        "pallas_tpu": PallasTpuAttention(),
        # Other libraries' kernels behind this contract (peers.py), where they are installed.
        **{t.name: t for t in map(TokamaxAttention, peers.TOKAMAX_IMPLEMENTATIONS)},
        "colabfold": ColabFoldAttention(),
        "colabfold_packed": ColabFoldAttention(packed=True),
    }
)
# Those of them that are other libraries' (peers.py): 'auto' takes one only where the GPU's tuning
# table names it (a sweep measured it correct and fastest there), never by its rules.
PEERS = tuple(name for name, impl in IMPLEMENTATIONS.items() if isinstance(impl, peers.PEER_TYPES))

# Largest float32 logits-and-weights working set of one batch row that 'auto' leaves to the dense
# implementation (which tiles over rows); longer rows go to the chunked one.
DENSE_ROW_BYTES = 16 * 2**20


@dataclasses.dataclass(frozen=True)
class Auto:
    """The 'auto' choice: rules, in order, applied to the real (per-device) shapes.

    1. On GPU, `mosaic` (Hopper, sm_90: TMA and wgmma) when it takes the inputs, else `pallas`
       (Triton, any GPU while JAX has that backend): both read a bias shared over the batch
       without copying it per row and keep its gradient O(N·T·S); else `cudnn` (half precision).
    1b. On TPU, `pallas_tpu` when it takes the inputs (float32, bfloat16; head dims <= 128; its
       tiles within VMEM): the same contract in Mosaic.
    2. `xla` when one batch row's float32 logits and weights, 2 * 4 * N * T * S bytes, fit in
       min(memory_budget_bytes, dense_row_bytes): it runs in tiles of rows, forward and backward,
       so its working set stays small whatever the batch. On 2 CPU cores the MSA-row and triangle
       shapes ran faster in row tiles than in query x key tiles (scripts/benchmark.py).
    3. Otherwise (long rows) `chunked`, whose query x key tiles bound the working set.

    Before the rules, on a GPU: what the GPU's tuning table (tuning.json) measured fastest for
    these inputs, among these implementations and `peers` (other libraries' kernels, peers.py);
    the rules themselves never take a peer, and a peer the table names that does not take the
    inputs here (not installed, say) leaves the choice to the rules.

    Attributes:
      memory_budget_bytes: the working-set budget (global_config.memory_budget_mib).
      dense_row_bytes: the largest row working set left to `xla`.
      xla, chunked, cudnn, mosaic, pallas, pallas_tpu: the instances to run (None: defaults,
        chunked with this budget).
      peers: the other libraries' instances the table may name (None: IMPLEMENTATIONS' PEERS;
        () : none).
    """

    memory_budget_bytes: int = memory.DEFAULT_MEMORY_BUDGET_BYTES
    dense_row_bytes: int = DENSE_ROW_BYTES
    xla: XlaAttention | None = None
    chunked: ChunkedAttention | None = None
    cudnn: CudnnAttention | None = None
    mosaic: MosaicAttention | None = None
    pallas: PallasAttention | None = None
    pallas_tpu: PallasTpuAttention | None = None
    peers: tuple[base.Implementation, ...] | None = None

    def __post_init__(self):
        checks.check_int("memory_budget_bytes", self.memory_budget_bytes)
        checks.check_int("dense_row_bytes", self.dense_row_bytes)
        defaults = dict(
            xla=XlaAttention(),
            chunked=ChunkedAttention(memory_budget_bytes=self.memory_budget_bytes),
            cudnn=CudnnAttention(),
            mosaic=MosaicAttention(),
            pallas=PallasAttention(),
            pallas_tpu=PallasTpuAttention(),
        )
        for name, default in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        if self.peers is None:
            object.__setattr__(self, "peers", tuple(IMPLEMENTATIONS[n] for n in PEERS))
        if not isinstance(self.peers, tuple) or not all(
            isinstance(p, base.Implementation) for p in self.peers
        ):
            raise TypeError(
                "peers must be None or a tuple of implementation instances (e.g. "
                f"(gated_attention.TokamaxAttention('triton'),)), got {self.peers!r}"
            )

    def choose(
        self, query, key, value, biases, mask, *, compute_dtype, options=base.PLAIN, platform=None
    ):
        """(implementation, reason) for these flattened inputs, compiled for `platform` (a
        platforms.KINDS name; None: the host's)."""
        scale = query.shape[-1] ** -0.5
        choice = self.pick(query, key, value, biases, mask, compute_dtype, options, platform, scale)
        return choice.impl, choice.reason

    def pick(
        self, query, key, value, biases, mask, compute_dtype, options, platform, scale
    ) -> Choice:
        """The Choice (implementation, its plan, reason) for these flattened inputs."""
        platform = platforms.host() if platform is None else platform
        args = (query, key, value, biases, mask)
        asked = dict(scale=scale, compute_dtype=compute_dtype, options=options, platform=platform)
        if platform == "gpu":  # what the device's run measured fastest, where it has an entry
            ours = (self.mosaic, self.pallas, self.cudnn, self.xla)
            tuned = measured((*ours, *self.peers), *args, **asked)
            if tuned is not None:
                return Choice(*tuned, compute_dtype)
        refused = []  # the kernels' reasons, kept in the reason of what runs instead
        for impl, what in self._kernels().get(platform, ()):
            try:
                plan = impl.plan(*args, **asked)
            except NotImplementedError as e:  # the next rule applies
                refused.append(f"{impl.name} refused: {e}")
                continue
            return Choice(
                impl, plan, "; ".join([*refused, f"{what} takes these inputs"]), compute_dtype
            )
        _, q_len, heads, _ = query.shape
        row_bytes = memory.dense_row_bytes(heads, q_len, key.shape[1])
        limit = min(self.memory_budget_bytes, self.dense_row_bytes)
        sizes = f"one row's dense logits need {_mib(row_bytes)} MiB, limit {_mib(limit)} MiB"
        impl = self.chunked if row_bytes > limit else self.xla
        return Choice(impl, impl.plan(*args, **asked), "; ".join([*refused, sizes]), compute_dtype)

    def _kernels(self) -> dict[str, tuple]:
        """Per platform kind, the kernels tried in order, each with what taking the inputs says."""
        return {
            "gpu": (
                (self.mosaic, "Hopper and the Mosaic GPU kernel"),
                (self.pallas, "GPU and the Pallas kernel"),
                (self.cudnn, "GPU and cuDNN"),
            ),
            "tpu": ((self.pallas_tpu, "TPU and the Pallas TPU kernel"),),
        }


class Choice(NamedTuple):
    """What runs for one platform kind: the implementation, the plan it made for these inputs
    (base.Implementation.plan; passed to its __call__), why, and the compute dtype."""

    impl: base.Implementation
    plan: Any
    reason: str
    compute_dtype: Any


Spec = str | base.Implementation | Auto | Sequence[str | base.Implementation] | None


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / memory.MIB:.3g}"


def _instance(item: Any, name: str) -> base.Implementation:
    if isinstance(item, base.Implementation):
        return item
    if isinstance(item, str) and item in IMPLEMENTATIONS:
        return IMPLEMENTATIONS[item]
    if isinstance(item, str):
        raise ValueError(
            f"{name} must be one of {('auto', *IMPLEMENTATIONS)}, an implementation instance or "
            f"a sequence of them, got {item!r}"
        )
    raise TypeError(
        f"{name} must be a name, an implementation instance (e.g. gated_attention.XlaAttention()) "
        f"or a sequence of them, got {type(item).__name__}"
    )


def resolve(implementation: Spec) -> Auto | tuple[base.Implementation, ...]:
    """Validates `implementation`: an Auto, or the implementations to try in order."""
    if implementation is None or implementation == "auto":
        return Auto()
    if isinstance(implementation, Auto):
        return implementation
    if isinstance(implementation, (list, tuple)):
        if not implementation:
            raise ValueError("implementation must not be an empty sequence")
        return tuple(_instance(x, f"implementation[{i}]") for i, x in enumerate(implementation))
    return (_instance(implementation, "implementation"),)


def describe(implementation: Spec) -> str:
    """A short label of an implementation spec, for logs and records."""
    if implementation is None or isinstance(implementation, (str, Auto)):
        return "auto" if not isinstance(implementation, str) else implementation
    if isinstance(implementation, (list, tuple)):
        return "(" + ", ".join(describe(x) for x in implementation) + ")"
    return implementation.name


def _pick(resolved, flat_args, compute_dtype, options, platform, scale) -> Choice:
    if isinstance(resolved, Auto):
        return resolved.pick(*flat_args, compute_dtype, options, platform, scale)
    asked = dict(scale=scale, compute_dtype=compute_dtype, options=options, platform=platform)
    reasons = []
    for impl in resolved:
        try:
            plan = impl.plan(*flat_args, **asked)
        except NotImplementedError as e:
            if len(resolved) == 1:
                raise NotImplementedError(
                    f"implementation={impl.name!r} cannot take these inputs: {e}"
                ) from None
            reasons.append(f"{impl.name}: {e}")
            continue
        first = "requested explicitly" if len(resolved) == 1 else "the first to take the inputs"
        return Choice(impl, plan, "; ".join([*reasons, first]), compute_dtype)
    raise NotImplementedError(
        "no implementation of the priority list takes these inputs: " + "; ".join(reasons)
    )


def choose_per_platform(resolved, kinds, flat_args, policy, options, scale) -> dict[str, Choice]:
    """{kind: Choice} for every kind the program may be compiled for where something takes the
    inputs, each implementation asked once for its plan; else NotImplementedError with each
    kind's reason (the inputs' or the host's first); a kind left out has no branch: compiling for
    it fails."""
    choices, errors = {}, []
    for kind in kinds:
        compute = numerics.compute_dtype(flat_args[0].dtype, policy, backend=kind)
        try:
            choices[kind] = _pick(resolved, flat_args, compute, options, kind, scale)
        except NotImplementedError as e:
            errors.append((kind, e))
    if not choices:  # a GPU kernel refused on the GPU too: its reason there, not the host's only
        (_, first), *others = errors
        others = "".join(f"; compiled for {kind}: {e}" for kind, e in others)
        raise (NotImplementedError(f"{first}{others}") if others else first) from None
    return choices


# The library's logger: DEBUG, and no handler of its own, so a program that asks for nothing sees
# nothing (Python's convention for libraries); docs/implementations.md says how to see the choices.
_LOG = logging.getLogger("gated_attention")
_logged: set[str] = set()  # the choices logged so far
_choice_logs = threading.local()  # this thread's open recorders: a trace reaches its own thread's


def _recorders() -> list[list[dict[str, Any]]]:
    if not hasattr(_choice_logs, "open"):
        _choice_logs.open = []
    return _choice_logs.open


@contextlib.contextmanager
def record_implementation_choices() -> Iterator[list[dict[str, Any]]]:
    """Collects the implementation chosen by every dot_product_attention traced inside the block
    by this thread (recorders nest; another thread's traces are its own).

    Yields:
      A list that receives one dict per traced call: requested, chosen, reason, platform (the
      kind they are for: the inputs' own, the host's, or the first of a staged branch's),
      by_platform ({kind: {chosen, reason, compute_dtype}} for every kind the call may be compiled
      for, platforms.py) and the flattened [B, T|S, N, H] shapes of query, key and value. A module
      whose compute dtype differs between those kinds ('auto' with bfloat16 inputs: float32 on
      CPU) traces one branch per dtype, so one of its calls records one entry per branch.
    """
    record: list[dict[str, Any]] = []
    recorders = _recorders()
    recorders.append(record)
    try:
        yield record
    finally:  # by identity: an empty inner recorder equals an empty outer one
        del recorders[next(i for i, r in enumerate(recorders) if r is record)]


def log_choice(requested: str, choices: dict[str, Choice], query, key, value) -> None:
    """Logs (once) and records (record_implementation_choices) what runs for each kind."""
    (kind, (impl, _, reason, _)), *others = choices.items()
    elsewhere = "".join(f"; on {k}: {c.impl.name}" for k, c in others)
    message = (
        f"dot_product_attention: {requested} -> {impl.name} on {kind} ({reason}){elsewhere}, "
        f"query {tuple(query.shape)}"
    )
    if message not in _logged and len(_logged) < 20:  # each choice once (init and apply trace)
        _logged.add(message)
        _LOG.debug("%s", message)
    shapes = dict(query=tuple(query.shape), key=tuple(key.shape), value=tuple(value.shape))
    by_platform = {
        k: dict(chosen=c.impl.name, reason=c.reason, compute_dtype=c.compute_dtype.name)
        for k, c in choices.items()
    }
    entry = dict(
        requested=requested,
        chosen=impl.name,
        reason=reason,
        platform=kind,
        by_platform=by_platform,
        **shapes,
    )
    for record in _recorders():
        record.append(dict(entry))
