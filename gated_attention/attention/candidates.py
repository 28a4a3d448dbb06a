"""Tuning candidates: the tunings of this library's GPU implementations a device sweep times, as
option values of each implementation's own dataclass fields (not forks of its code).

An implementation declares what a target can take (base.Implementation.candidates, its
CANDIDATE_FIELDS): tiles, warps and pipeline stages and batch rows a program (PallasAttention),
keys a tile (MosaicAttention, Hopper only), the instance as it is (cuDNN, XLA, and the peers:
tokamax's and ColabFold's kernels, where the GPU, dtype and head dim suit them). A candidate here
is one of them with a stable name, every field spelled out so that a name means the same tuning
whatever the defaults become:

    pallas:bq64,bk64,w4,s2,r2    mosaic:bk128    cudnn    xla    tokamax_triton    colabfold

gated_attention_tools/sweep.py times every candidate a device takes at AlphaFold 2's cells;
gated_attention_tools/tuning_table.py writes the fastest's options into tuning.json; 'auto' builds
the implementation with them on that device (per_mode.measured). A new kernel option joins the
sweep by being a field of its implementation, in CANDIDATE_FIELDS and in candidates()' list.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from gated_attention.attention import base
from gated_attention.attention.dispatch import IMPLEMENTATIONS, PEERS

# What Auto may take on a GPU: the implementations a sweep times and the table records, ours and
# other libraries' (PEERS: tokamax's and ColabFold's, peers.py), timed and checked beside ours.
OURS = ("mosaic", "pallas", "cudnn", "xla")
GPU = (*OURS, *PEERS)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One tuning of one implementation.

    Attributes:
      implementation: its name in IMPLEMENTATIONS.
      options: ((field, value), ...) in the implementation's CANDIDATE_FIELDS order (hashable).
    """

    implementation: str
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def name(self) -> str:
        """'pallas:bq64,bk64,w4,s2,r2': the implementation, then each field's label and value."""
        labels = type(IMPLEMENTATIONS[self.implementation]).CANDIDATE_FIELDS
        spelled = ",".join(f"{labels[f]}{_spell(v)}" for f, v in self.options)
        return f"{self.implementation}:{spelled}" if spelled else self.implementation

    def as_dict(self) -> dict[str, Any]:
        return dict(self.options)

    def build(self, *, interpret: bool = False) -> base.Implementation:
        """The implementation with these options; `interpret` where it has that field."""
        impl = IMPLEMENTATIONS[self.implementation]
        extra = dict(interpret=True) if interpret and _has_field(impl, "interpret") else {}
        return dataclasses.replace(impl, **self.as_dict(), **extra)


def _spell(value) -> str:
    return str(int(value)) if isinstance(value, bool) else str(value)


def _has_field(impl, field: str) -> bool:
    return field in {f.name for f in dataclasses.fields(impl)}


def candidate(implementation: str, options: Mapping[str, Any] | None = None) -> Candidate:
    """The Candidate of `implementation` with `options` (fields of its CANDIDATE_FIELDS).

    Raises:
      ValueError: an implementation not in GPU, or a field it does not tune.
      TypeError: options not a mapping.
    """
    if implementation not in GPU:
        raise ValueError(f"implementation must be one of {GPU}, got {implementation!r}")
    options = {} if options is None else options
    if not isinstance(options, Mapping):
        raise TypeError(
            f"options must be a mapping of field to value, got {type(options).__name__}"
        )
    fields = type(IMPLEMENTATIONS[implementation]).CANDIDATE_FIELDS
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise ValueError(
            f"options of {implementation!r} must be fields of {sorted(fields)}, got {unknown}"
        )
    return Candidate(implementation, tuple((f, options[f]) for f in fields if f in options))


def for_target(
    capability: tuple[int, int] | None,
    dtype,
    head_dim: int,
    *,
    bias: str = "shared",
    mask: str = "key",
    implementations: tuple[str, ...] = GPU,
) -> list[Candidate]:
    """Every candidate of `implementations` a GPU of compute `capability` takes for inputs of
    `dtype` and `head_dim` in this kernel form (base.Implementation.candidates), in their order."""
    if not isinstance(capability, tuple) or len(capability) != 2:
        raise TypeError(f"capability must be a (major, minor) tuple, got {capability!r}")
    out = []
    for name in implementations:
        impl = candidate(name).build()  # a peer's candidates depend on its fields (peers.py)
        for options in impl.candidates(capability, dtype, head_dim, bias=bias, mask=mask):
            out.append(candidate(name, options))
    return out
