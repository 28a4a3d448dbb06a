"""The library's config schema: every key, its default and its validation, in one place.

Modules take AlphaFold 2's ConfigDicts (or plain dicts) as they are and turn them into frozen
dataclasses here, so module code never calls config.get(key, default):

* a module config (AF2's `config.attention`-style dict) is strict: an unknown key such as `num_heads`
  raises ValueError naming it;
* a global config carries many keys of the whole model (AF2's and ColabFold's); keys we do not use are
  ignored, but a key that looks like a misspelling of one of ours raises ValueError.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

import ml_collections

from gated_attention.attention import dispatch
from gated_attention.attention.xla_chunked.implementation import ChunkedAttention
from gated_attention.core import checks, memory, numerics, platforms

ORIENTATIONS = ("per_row", "per_column")
DEFAULT_MEMORY_BUDGET_MIB = memory.DEFAULT_MEMORY_BUDGET_BYTES // memory.MIB
IMPLEMENTATION_NAMES = ("auto", *dispatch.IMPLEMENTATIONS)
# What a module's row tiles save for the backward pass (modules.remat_saveable).
REMAT_POLICIES = ("nothing", "projections", "everything")


def _as_dict(config: Any, name: str) -> dict[str, Any]:
    if isinstance(config, ml_collections.ConfigDict | ml_collections.FrozenConfigDict):
        return dict(config.items())
    if isinstance(config, Mapping):
        return dict(config)
    raise TypeError(
        f"{name} must be an ml_collections.ConfigDict or a mapping, got {type(config).__name__}"
    )


def _check_int(where: str, key: str, value: Any, minimum: int, optional: bool) -> None:
    checks.check_int(f"{where}.{key}", value, minimum=minimum, optional=optional)


def _check_bool(where: str, key: str, value: Any) -> None:
    checks.check_bool(f"{where}.{key}", value)


def _check_implementation(where: str, key: str, value: Any, optional: bool) -> None:
    if (value is None and optional) or value in IMPLEMENTATION_NAMES:
        return
    raise ValueError(
        f"{where}.{key} must be one of {IMPLEMENTATION_NAMES}{' or None' if optional else ''}, "
        f"got {value!r}"
    )


def _check_budget(where: str, key: str, value: Any, optional: bool) -> None:
    if value is None and optional:
        return
    checks.check_positive_number(f"{where}.{key}", value, unit="MiB")


@dataclasses.dataclass(frozen=True)
class ModuleConfig:
    """A validated module config (AF2's per-module attention config plus our overrides).

    Attributes:
      num_head: number of heads (required).
      gating: sigmoid gating of the attention output.
      key_dim: total query/key channels over all heads (None: the query input's channel count).
      value_dim: total value channels over all heads (None: the key input's channel count).
      orientation: 'per_row' or 'per_column' (family modules).
      dropout_rate: dropout applied by the family modules to their update.
      shared_dropout: share the dropout mask along the orientation's axis.
      attention_implementation: overrides global_config's when not None.
      query_chunk_size, key_chunk_size, memory_budget_mib: override global_config's when not None.
    """

    num_head: int
    gating: bool = True
    key_dim: int | None = None
    value_dim: int | None = None
    orientation: str = "per_row"
    dropout_rate: float = 0.0
    shared_dropout: bool = True
    attention_implementation: str | None = None
    query_chunk_size: int | None = None
    key_chunk_size: int | None = None
    memory_budget_mib: float | None = None

    def __post_init__(self):
        where = "config"
        _check_int(where, "num_head", self.num_head, 1, optional=False)
        _check_bool(where, "gating", self.gating)
        _check_int(where, "key_dim", self.key_dim, 1, optional=True)
        _check_int(where, "value_dim", self.value_dim, 1, optional=True)
        if self.orientation not in ORIENTATIONS:
            raise ValueError(
                f"config.orientation must be one of {ORIENTATIONS}, got {self.orientation!r}"
            )
        checks.check_rate("config.dropout_rate", self.dropout_rate)
        _check_bool(where, "shared_dropout", self.shared_dropout)
        _check_implementation(
            where, "attention_implementation", self.attention_implementation, True
        )
        _check_int(where, "query_chunk_size", self.query_chunk_size, 1, optional=True)
        _check_int(where, "key_chunk_size", self.key_chunk_size, 1, optional=True)
        _check_budget(where, "memory_budget_mib", self.memory_budget_mib, optional=True)


@dataclasses.dataclass(frozen=True)
class GlobalConfig:
    """A validated global config: the keys of AF2's global_config we use, plus ours.

    Attributes:
      zero_init: initialize output_w to zeros (AF2), else glorot uniform.
      subbatch_size: inference subbatch over the batch axis (None: off; 'auto': from the budget).
      deterministic: no dropout.
      eval_dropout: dropout also when not training (AF2).
      attention_implementation: 'auto' or an implementation name.
      query_chunk_size, key_chunk_size: tile sizes for 'chunked' (None: from the budget).
      memory_budget_mib: the working-set budget of the modules' row tiles and pair-bias tiles and
        of 'auto''s choice; None (the default): per platform, DEFAULT_MEMORY_BUDGET_MIB on CPU
        and TPU, gpu_memory_fraction of the device's memory on a GPU (Resolved.budget_bytes).
      gpu_memory_fraction: with memory_budget_mib None, the share of a GPU's memory the row and
        pair-bias tiles may take: a module at AlphaFold's sizes is then one kernel call, not a
        loop of CPU-sized tiles (0.1 of an 80 GB GPU: 8 GB).
      compute_dtype: precision policy, one of numerics.POLICIES ('auto': bfloat16/float16 inputs
        are computed in float32 on CPU; 'input': in their own dtype, as AF2; 'float32').
      remat_policy: what a module's row tiles (and GlobalAttention over a ring, untiled)
        save for the backward pass (training memory):
        'nothing' (the tile recomputed: the least memory, and on CPU the fastest), 'projections'
        (q/k/v/gate kept, attention recomputed) or 'everything' (nothing recomputed). See
        modules.remat_saveable.
      shard_rows_over: None, or the mesh axis (or axes) of the context mesh (jax.set_mesh) that
        the rows are split over: each device then computes the module for its own rows in a
        shard_map (sharding.mesh_axes), under Auto axes as under Explicit ones; the column-wise
        modules turn to columns and back with one all-to-all each way.
      shard_columns_over: None, or the mesh axis (axes) that the positions a module attends over
        are split over (context parallelism, ring.py): Attention's query and key positions,
        GlobalAttention's positions (the op's ring splits its heads: num_head must divide by
        the devices); with shard_rows_over, the pair [N, N, c] and the MSA [S, N, c] tiled over
        a 2D grid (rows over one, columns over the other) for TriangleAttention and MSA row,
        MSA column and MSA column global attention, each attending along its split axis by a
        ring of key blocks (column global attention sums its masked mean over the devices).
    """

    zero_init: bool = True
    subbatch_size: int | str | None = 4
    deterministic: bool = False
    eval_dropout: bool = False
    attention_implementation: str = "auto"
    query_chunk_size: int | None = None
    key_chunk_size: int | None = None
    memory_budget_mib: float | None = None
    gpu_memory_fraction: float = 0.1
    compute_dtype: str = "auto"
    remat_policy: str = "nothing"
    shard_rows_over: str | tuple[str, ...] | None = None
    shard_columns_over: str | tuple[str, ...] | None = None

    def __post_init__(self):
        where = "global_config"
        for field in ("shard_rows_over", "shard_columns_over"):
            axes = getattr(self, field)
            if isinstance(axes, list):
                axes = tuple(axes)
                object.__setattr__(self, field, axes)
            names = (axes,) if isinstance(axes, str) else axes
            if axes is not None and (
                not isinstance(names, tuple)
                or not names
                or not all(isinstance(a, str) for a in names)
            ):
                raise ValueError(
                    f"{where}.{field} must be None, a mesh axis name or a tuple of them, "
                    f"got {axes!r}"
                )
        rows, columns = (
            set((a,) if isinstance(a, str) else a or ())
            for a in (self.shard_rows_over, self.shard_columns_over)
        )
        if rows & columns:
            raise ValueError(
                f"{where}.shard_rows_over={self.shard_rows_over!r} and shard_columns_over="
                f"{self.shard_columns_over!r} share {sorted(rows & columns)}: one axis splits one "
                "dimension"
            )
        checks.check_one_of(f"{where}.compute_dtype", self.compute_dtype, numerics.POLICIES)
        checks.check_one_of(f"{where}.remat_policy", self.remat_policy, REMAT_POLICIES)
        _check_bool(where, "zero_init", self.zero_init)
        if self.subbatch_size != "auto":
            _check_int(where, "subbatch_size", self.subbatch_size, 1, optional=True)
        _check_bool(where, "deterministic", self.deterministic)
        _check_bool(where, "eval_dropout", self.eval_dropout)
        _check_implementation(
            where, "attention_implementation", self.attention_implementation, False
        )
        _check_int(where, "query_chunk_size", self.query_chunk_size, 1, optional=True)
        _check_int(where, "key_chunk_size", self.key_chunk_size, 1, optional=True)
        _check_budget(where, "memory_budget_mib", self.memory_budget_mib, optional=True)
        fraction = self.gpu_memory_fraction
        if (
            isinstance(fraction, bool)
            or not isinstance(fraction, int | float)
            or not 0 < fraction <= 1
        ):
            raise ValueError(
                f"{where}.gpu_memory_fraction must be a number in (0, 1], got {fraction!r}"
            )


_MODULE_KEYS = tuple(f.name for f in dataclasses.fields(ModuleConfig))
_GLOBAL_KEYS = tuple(f.name for f in dataclasses.fields(GlobalConfig))
# Global keys whose None is a value, not "take the default": AF2's subbatch_size=None turns
# subbatching off (the default, 4, is AF2's config value).
_GLOBAL_KEYS_WHERE_NONE_MEANS_OFF = ("subbatch_size",)


def module_config(config: Any) -> ModuleConfig:
    """Validates a module config (ConfigDict, mapping or ModuleConfig); unknown keys raise.

    Keys whose value is None take the default (AF2 leaves key_dim/value_dim absent).
    """
    if isinstance(config, ModuleConfig):
        return config
    values = _as_dict(config, "config")
    unknown = sorted(set(values) - set(_MODULE_KEYS))
    if unknown:
        hints = [
            f"{k!r} (did you mean {difflib.get_close_matches(k, _MODULE_KEYS, 1)[0]!r}?)"
            if difflib.get_close_matches(k, _MODULE_KEYS, 1)
            else repr(k)
            for k in unknown
        ]
        raise ValueError(
            f"config has unknown key(s) {', '.join(hints)}; known keys: {_MODULE_KEYS}"
        )
    if "num_head" not in values or values["num_head"] is None:
        raise ValueError(
            f"config.num_head is required (an int >= 1), got config keys {sorted(values)}"
        )
    return ModuleConfig(**{k: v for k, v in values.items() if v is not None})


def global_config(config: Any) -> GlobalConfig:
    """Validates a global config (ConfigDict, mapping or GlobalConfig).

    Keys we do not use (AF2's bfloat16, use_remat, multimer_mode, ...) are ignored; a key close to
    one of ours (difflib ratio >= 0.85, e.g. 'zero_int') raises ValueError as a likely typo. A key
    set to None takes its default, except subbatch_size, where None turns subbatching off (AF2).
    """
    if isinstance(config, GlobalConfig):
        return config
    values = _as_dict(config, "global_config")
    for key in set(values) - set(_GLOBAL_KEYS):
        close = difflib.get_close_matches(key, _GLOBAL_KEYS, 1, cutoff=0.85)
        if close:
            raise ValueError(f"global_config has unknown key {key!r}; did you mean {close[0]!r}?")
    return GlobalConfig(
        **{
            k: values[k]
            for k in _GLOBAL_KEYS
            if k in values and (values[k] is not None or k in _GLOBAL_KEYS_WHERE_NONE_MEANS_OFF)
        }
    )


def memory_budget_mib(module: ModuleConfig, glob: GlobalConfig) -> float | None:
    """The module's working-set budget, its own where set, else the global one (None: per
    platform, Resolved.budget_bytes): one value for the op's choice, the module's row tiles and
    its pair-bias tiles."""
    return glob.memory_budget_mib if module.memory_budget_mib is None else module.memory_budget_mib


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A module's configuration resolved once, in its constructor, and passed down as values.

    Attributes:
      implementation: what it passes to dot_product_attention (an instance with its tuning, or
        an Auto with the module's budget).
      compute_dtype: the precision policy (numerics.POLICIES).
      budget_mib: the working-set budget: the op's choice, the row tiles and the pair-bias tiles
        (None: per platform, budget_bytes).
      remat_policy: what a row tile saves for the backward pass (REMAT_POLICIES).
      gpu_memory_fraction: a GPU's share for the tiles when budget_mib is None.
    """

    implementation: Any
    compute_dtype: str
    budget_mib: float | None
    remat_policy: str
    gpu_memory_fraction: float = 0.1

    def budget_bytes(self, kind: str) -> int:
        """The tiles' budget on a platform kind ('cpu', 'gpu', 'tpu'): budget_mib where set;
        else on a GPU whose memory is known (platforms.gpu_memory_bytes) gpu_memory_fraction of
        it, elsewhere DEFAULT_MEMORY_BUDGET_MIB, sized for a CPU's caches and a TPU's 16 GiB."""
        if self.budget_mib is not None:
            return memory.budget_bytes(self.budget_mib)
        device = platforms.gpu_memory_bytes() if kind == "gpu" else None
        if device is None:
            return memory.DEFAULT_MEMORY_BUDGET_BYTES
        return max(memory.DEFAULT_MEMORY_BUDGET_BYTES, int(device * self.gpu_memory_fraction))


def resolve(module: ModuleConfig, glob: GlobalConfig) -> Resolved:
    """The module's Resolved configuration: module keys override global ones."""
    implementation, policy = attention_implementation(module, glob)
    budget = memory_budget_mib(module, glob)
    return Resolved(implementation, policy, budget, glob.remat_policy, glob.gpu_memory_fraction)


def attention_implementation(module: ModuleConfig, glob: GlobalConfig) -> tuple[Any, str]:
    """The implementation (an instance with its tuning) and precision policy a module passes to
    dot_product_attention: module keys override global ones."""

    def pick(key):
        value = getattr(module, key)
        return getattr(glob, key) if value is None else value

    budget = memory_budget_mib(module, glob)  # the op decides for the host: None, the default
    budget = memory.DEFAULT_MEMORY_BUDGET_BYTES if budget is None else memory.budget_bytes(budget)
    chunked = ChunkedAttention(
        query_chunk_size=pick("query_chunk_size"),
        key_chunk_size=pick("key_chunk_size"),
        memory_budget_bytes=budget,
    )
    name = pick("attention_implementation")
    if name == "auto":
        implementation = dispatch.Auto(memory_budget_bytes=budget, chunked=chunked)
    else:
        implementation = chunked if name == "chunked" else dispatch.IMPLEMENTATIONS[name]
    return implementation, glob.compute_dtype
