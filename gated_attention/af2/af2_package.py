"""AlphaFold 2's own model (the `alphafold-colabfold` package) running this library's attention.

AF2's `alphafold.model.modules` builds its attention modules by name when a block is traced:
EvoformerIteration (monomer and multimer, main and extra MSA stacks) and the template pair stack
look up `modules.MSARowAttentionWithPairBias`, `MSAColumnAttention`, `MSAColumnGlobalAttention`
and `TriangleAttention`, and the template embedding's pointwise attention (Suppl. Alg. 17) looks up
`modules.Attention`, at call time. Inside `use_gated_attention()` all six names, `Attention` and
`GlobalAttention` included, are this library's modules, which take AF2's configs, call signatures
and parameter names, so no attention of AF2's model stays AF2's and AF2's parameters (a checkpoint,
or ones its own `init` made) apply unchanged:

    from alphafold.model import config, modules
    import gated_attention as ga

    @ga.af2_package.use_gated_attention()        # or: with ga.af2_package.use_gated_attention():
    def evoformer(msa, pair, msa_mask, pair_mask):
        c = config.model_config("model_1").model
        block = modules.EvoformerIteration(c.embeddings_and_evoformer.evoformer,
                                           c.global_config, is_extra_msa=False)
        return block({"msa": msa, "pair": pair}, {"msa": msa_mask, "pair": pair_mask},
                     is_training=False)

    fn = hk.transform(evoformer)            # traced inside the decorator: AF2 with our attention

`Attention` and `GlobalAttention` are swapped for AF2Attention and AF2GlobalAttention, thin
adapters of ours to the package's interfaces (its additive bias argument, ColabFold's fused-kernel
hooks), so swapping only them (e.g. {"Attention": AF2Attention}) leaves AF2's own family modules
working, on our attention. The structure module's InvariantPointAttention is not one of these.

The swap lasts while the decorated function runs (which is when hk.transform and jax.jit trace it),
so code outside it keeps AF2's modules. On first use each swapped name of AF2's module becomes a
dispatcher that builds AF2's class or ours by the swap active in the calling thread (a JAX config
state, thread-local and part of jax.jit's trace context): another thread tracing AF2 meanwhile
builds AF2's modules, and a function jitted outside the swap is traced again inside it (and the
reverse), never served the other attention from jax.jit's cache. AF2's dropout_wrapper applies
dropout and the residual to our modules' updates as to its own (they return the update and carry
AF2's module config).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import threading
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp

from gated_attention.af2 import family as alphafold
from gated_attention.af2 import modules
from gated_attention.core import compat
from gated_attention.parallel import sharding


class AF2Attention(modules.Attention):
    """gated_attention.Attention with alphafold-colabfold's `modules.Attention` interface.

    AF2 passes its mask as an additive float bias (0, or big_neg for masked keys) and builds the
    module as Attention(config, global_config, output_dim, name, trim); ColabFold's family modules
    first ask it for fused kernels (packed_kernel, ln_projection_kernel) and call it when there are
    none, which is always here. Parameters (query_w, key_w, value_w, gating_w, gating_b, output_w,
    output_b) are AF2's, so AF2's family modules and template embedding run unchanged on it.
    """

    def __init__(
        self,
        config: Any,
        global_config: Any,
        output_dim: int,
        name: str = "attention",
        trim: bool = False,
    ):
        """Constructs the module.

        Args:
          config: AF2's attention config (num_head, gating, optional key_dim/value_dim, ...).
          global_config: AF2's global config plus ours (config.GlobalConfig).
          output_dim: channels of the output.
          name: Haiku module name.
          trim: ColabFold's hint that its packed kernel may skip masked rows; stored, no effect
            (there is no packed kernel here, and it changes no result on AF2's plain path).
        """
        if not isinstance(trim, bool):
            raise TypeError(f"trim must be a bool, got {trim!r}")
        super().__init__(config, global_config, output_dim, name=name)
        self.trim = trim

    def packed_kernel(self, act: jax.Array) -> None:
        """ColabFold's packed-projection kernel hook: None, so AF2's code calls the module."""
        del act
        return None

    def ln_projection_kernel(self, act: jax.Array) -> None:
        """ColabFold's fused LayerNorm-projection kernel hook: None (AF2's plain path)."""
        del act
        return None

    def __call__(self, q_data, m_data, bias, nonbatched_bias=None) -> jax.Array:
        """AF2's call: q_data [..., b, q, a] attends to m_data [..., b, k, m].

        Args:
          q_data: queries (and gate input).
          m_data: keys and values, q_data's dtype.
          bias: AF2's additive float bias, broadcastable (numpy rules, as AF2 adds it to its
            logits) to [..., b, h, q, k], e.g. [b, 1, 1, k] or the template embedding's [1, 1, 1, T];
            keys at or below -logit_clip are masked as AF2's clip masks them (mask_from_bias).
          nonbatched_bias: None, [h, q, k] or [q, k], shared by the batch.

        Returns:
          [..., b, q, output_dim] in q_data's dtype.
        """
        logits_rank = q_data.ndim + 1  # [..., b, h, q, k]
        mask = None
        if bias is not None:
            if bias.ndim < logits_rank:  # AF2 broadcasts missing leading axes
                bias = bias.reshape((1,) * (logits_rank - bias.ndim) + tuple(bias.shape))
            mask, bias = mask_from_bias(bias)
        return super().__call__(q_data, m_data, mask, nonbatched_bias, bias=bias)


def logit_clip(dtype) -> float:
    """The bound AF2 clips its logits to before the softmax (alphafold-colabfold's
    half_precision.logit_clip; ColabDesign clips to 1e8 in every dtype)."""
    return 1e4 if jnp.dtype(dtype) == jnp.float16 else 1e8


def mask_from_bias(bias: jax.Array) -> tuple[jax.Array, jax.Array]:
    """AF2's additive bias as the mask it stands for, and what is left of it.

    AF2 (alphafold-colabfold and ColabDesign alike) adds `1e9 * (mask - 1)` to its logits and
    clips them to +-logit_clip: a key biased to -logit_clip or below gets weight 0 and no gradient,
    and a query with no other key averages all keys uniformly, with no gradient to its logits. That
    is this library's boolean mask; passed on as an additive bias instead, such a row would take
    the unclipped softmax's gradient through -1e9 + logits (float32 rounding), AF2's neither.

    Returns:
      (mask, bias): bool, True where bias > -logit_clip; bias there, 0 elsewhere.
    """
    keep = bias > -logit_clip(bias.dtype)
    return keep, jnp.where(keep, bias, jnp.zeros((), bias.dtype))


class AF2GlobalAttention(modules.GlobalAttention):
    """gated_attention.GlobalAttention with alphafold-colabfold's `modules.GlobalAttention` call.

    The constructor and call (q_data, m_data, q_mask [..., b, q, 1], and ColabDesign's unread
    bias) are AF2's already; the one difference is the output without gating, which AF2 returns
    as [..., b, 1, o] (one row for every query) and ours broadcasts to [..., b, q, o]: here it is
    AF2's shape.
    """

    def __call__(self, q_data, m_data, q_mask, bias=None) -> jax.Array:
        """AF2's call: global attention from q_data's masked mean to m_data.

        Args:
          q_data: [..., b, q, a].
          m_data: [..., b, k, m] with k == q.
          q_mask: [..., b, q, 1] float 0/1 (or bool) mask of q_data's (and m_data's) positions.
          bias: ColabDesign's fourth argument, `1e9 * (mask - 1)` of q_mask: its own module does
            not read it (it builds the bias from q_mask again), nor does this one.

        Returns:
          [..., b, q, output_dim] with config.gating, else [..., b, 1, output_dim].
        """
        del bias
        out = super().__call__(q_data, m_data, q_mask)
        return out if self.config.gating else out[..., :1, :]


# AF2's class names in alphafold.model.modules, and ours that replace them: the attention family
# and the two attention modules (the template embedding's pointwise attention is Attention).
FAMILY = {
    "MSARowAttentionWithPairBias": alphafold.MSARowAttentionWithPairBias,
    "MSAColumnAttention": alphafold.MSAColumnAttention,
    "MSAColumnGlobalAttention": alphafold.MSAColumnGlobalAttention,
    "TriangleAttention": alphafold.TriangleAttention,
}
REPLACEMENTS = {**FAMILY, "Attention": AF2Attention, "GlobalAttention": AF2GlobalAttention}

_LOCK = threading.Lock()  # guards installing the dispatchers (_install), never held by a swap

# The swap active in this thread: a key of _SWAPS, or None. In the trace context, so jax.jit traces
# a function anew when it is called under another swap (no cached trace of the other attention).
_ACTIVE = compat.trace_context_state(
    "gated_attention_af2_swap",
    None,
    "The gated_attention AF2 swap active in this thread (af2_package.use_gated_attention).",
)
_SWAPS: dict[str, tuple[ModuleType, dict[str, Any]]] = {}  # key -> (target, name -> class)
_ORIGINALS: dict[tuple[int, str], Any] = {}  # (id(target), name) -> AF2's class


def current_class(target: ModuleType, name: str) -> Any:
    """The class `target.name` stands for in this thread: the active swap's, or AF2's own."""
    key = _ACTIVE.value
    if key is not None:
        swapped_target, classes = _SWAPS[key]
        if swapped_target is target and name in classes:
            return classes[name]
    return _ORIGINALS[id(target), name]


def _dispatcher(target: ModuleType, name: str, original: type) -> type:
    """A stand-in for AF2's class `name` that builds the class current_class names."""

    def build(cls, *args, **kwargs):
        return current_class(target, name)(*args, **kwargs)

    namespace = dict(
        __new__=build, __doc__=original.__doc__, __module__=original.__module__, original=original
    )
    return type(name, (), namespace)


def _install(target: ModuleType, names) -> dict[str, Any]:
    """Dispatchers for `names` in `target` (once); AF2's classes by name."""
    with _LOCK:
        for name in names:
            if (id(target), name) not in _ORIGINALS:
                original = getattr(target, name)
                _ORIGINALS[id(target), name] = original
                setattr(target, name, _dispatcher(target, name, original))
        return {name: _ORIGINALS[id(target), name] for name in names}


def original_class(target: ModuleType, name: str) -> Any:
    """AF2's own class `name` of `target`, whether or not a dispatcher stands in for it."""
    return _ORIGINALS.get((id(target), name), getattr(target, name))


def alphafold_modules() -> ModuleType:
    """`alphafold.model.modules` from the alphafold-colabfold package, or an ImportError saying how
    to install it."""
    try:
        return importlib.import_module("alphafold.model.modules")
    except ImportError as e:
        raise ImportError(
            "AlphaFold 2's model is not installed: pip install 'alphafold-colabfold==2.3.27' "
            f"'colabfold-kernels==0.9.0' (or this package's [test] extra); import failed with: {e}"
        ) from e


def _placement(global_config: Any):
    """sharding.mesh_axes of an AF2 global config's shard_rows_over (None when it has none, and
    while Haiku initializes: parameters need no layout)."""
    names = global_config.get("shard_rows_over") if hasattr(global_config, "get") else None
    return None if hk.running_init() else sharding.mesh_axes(names)


def _without_residual(signature: inspect.Signature, args, kwargs):
    """The call's arguments after (act, mask) less AF2's `residual`, and that residual (None
    where the target's signature has none: ColabDesign's `(act, mask)`)."""
    if "residual" not in signature.parameters:
        return None, args, kwargs
    bound = signature.bind(None, None, None, *args, **kwargs)
    residual = bound.arguments.pop("residual", None)
    return residual, bound.args[3:], bound.kwargs


@functools.cache  # the same classes each time: a swap's configuration keeps one key
def dap_layouts(target: ModuleType) -> dict[str, type]:
    """AF2's TriangleMultiplication and OuterProductMean (subclassed from `target`'s, so names and
    parameters are AF2's) with DAP's layouts placed around them when global_config.shard_rows_over
    splits the rows over devices: the incoming triangle multiplication ('kjc,kic->ijc', a sum over
    rows) and the outer product mean (a sum over the MSA's rows) run on the columns, turned so by
    one all-to-all, and hand the rows back; otherwise XLA's partitioner would sum each device's
    partial [N_res, N_res, ...] product and reduce it over the devices. Their other operand is
    gathered, as in FastFold's DAP. Each takes its target's call: (act, mask) first, then what that
    modules.py takes (alphafold-colabfold's is_training and residual, nothing in ColabDesign's)."""
    triangle_base = original_class(target, "TriangleMultiplication")
    outer_base = original_class(target, "OuterProductMean")
    triangle_call = inspect.signature(triangle_base.__call__)
    outer_call = inspect.signature(outer_base.__call__)

    class TriangleMultiplication(triangle_base):
        def __call__(self, left_act, left_mask, *args, **kwargs):
            placement = _placement(self.global_config)
            over_rows = self.config.equation.split("->")[0].split(",")[0].startswith("k")
            if placement is None or not over_rows:
                return super().__call__(left_act, left_mask, *args, **kwargs)
            residual, args, kwargs = _without_residual(triangle_call, args, kwargs)
            columns = lambda x, d: sharding.split_along(x, placement, d)
            out = super().__call__(columns(left_act, -2), columns(left_mask, -1), *args, **kwargs)
            out = sharding.split_along(out, placement, -3)
            return out if residual is None else residual + out

    class OuterProductMean(outer_base):
        def __call__(self, act, mask, *args, **kwargs):
            placement = _placement(self.global_config)
            if placement is None:
                return super().__call__(act, mask, *args, **kwargs)
            residual, args, kwargs = _without_residual(outer_call, args, kwargs)
            act = sharding.split_along(act, placement, -2)
            mask = sharding.split_along(mask, placement, -1)
            out = super().__call__(act, mask, *args, **kwargs)
            out = sharding.split_along(out, placement, -3)
            return out if residual is None else residual + out

    return dict(TriangleMultiplication=TriangleMultiplication, OuterProductMean=OuterProductMean)


class _Swap(compat.TracedSwap):
    """Context manager and decorator: AF2's attention classes replaced, in this thread, while it
    is active (the module docstring)."""

    def __init__(
        self,
        replacements: Mapping[str, Any] | None,
        target: ModuleType | None,
        layouts: bool = True,
        load: Callable[[], ModuleType] | None = None,
    ):
        self._layouts, self._load = layouts, load or alphafold_modules
        replacements = dict(REPLACEMENTS if replacements is None else replacements)
        unknown = sorted(set(replacements) - set(REPLACEMENTS))
        if unknown:
            raise ValueError(
                f"replacements names {unknown}, which are not AF2 attention modules; expected "
                f"keys among {sorted(REPLACEMENTS)}"
            )
        self._replacements = replacements
        self._target = target
        super().__init__(_ACTIVE, _SWAPS)

    def __enter__(self) -> ModuleType:
        target = self._target or self._load()
        missing = [name for name in self._replacements if not hasattr(target, name)]
        if missing:
            raise AttributeError(
                f"{target.__name__} has no {missing}: not an AlphaFold 2 modules.py this "
                "integration knows (tested with alphafold-colabfold 2.3.27 and ColabDesign's "
                "1.1.1 and 1.1.3)"
            )
        replacements = dict(self._replacements)
        if self._layouts:
            replacements |= dict(dap_layouts(target))
        _install(target, replacements)
        outer = _ACTIVE.value
        classes = dict(_SWAPS[outer][1]) if outer is not None and _SWAPS[outer][0] is target else {}
        classes |= replacements  # nested swaps keep the outer's others
        # One key per configuration: jax.jit's cache then serves a swap's trace to the same swap.
        key = f"{target.__name__}:" + ",".join(
            f"{name}={cls.__module__}.{cls.__qualname__}@{id(cls):x}"
            for name, cls in sorted(classes.items())
        )
        self._activate(key, (target, classes))
        return target


def use_gated_attention(
    replacements: Mapping[str, Any] | None = None,
    *,
    target: ModuleType | None = None,
    layouts: bool = True,
) -> _Swap:
    """AF2's attention modules replaced by this library's, as a context manager or a decorator.

    Args:
      replacements: AF2 class name -> module class; None: all six of REPLACEMENTS (FAMILY's four,
        Attention and GlobalAttention). A subset swaps only those (e.g. {"TriangleAttention":
        ga.TriangleAttention}, or {"Attention": AF2Attention} under AF2's own family modules).
      target: the modules.py to patch; None: alphafold.model.modules (imported on entry).
      layouts: also AF2's TriangleMultiplication and OuterProductMean with DAP's layouts
        (dap_layouts), which act only when global_config.shard_rows_over splits the rows.

    Returns:
      A reusable, re-entrant context manager (entering it returns the patched module) that is
      also a decorator: the swap holds while the decorated function runs.
    """
    return _Swap(replacements, target, layouts)
