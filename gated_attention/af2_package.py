"""AlphaFold 2's own model (the `alphafold-colabfold` package) running this library's attention.

AF2's `alphafold.model.modules` builds its attention modules by name when a block is traced:
EvoformerIteration (monomer and multimer, main and extra MSA stacks) and the template pair stack
look up `modules.MSARowAttentionWithPairBias`, `MSAColumnAttention`, `MSAColumnGlobalAttention`
and `TriangleAttention` at call time. Inside `use_gated_attention()` those names are this
library's modules, which take AF2's configs, call signatures and parameter names, so AF2's
parameters (a checkpoint, or ones its own `init` made) apply unchanged:

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

The swap lasts while the decorated function runs (which is when hk.transform and jax.jit trace it),
so code outside it keeps AF2's modules. It changes module attributes, so do not trace AF2 with and
without it from two threads at once. AF2's dropout_wrapper applies dropout and the residual to our
modules' updates as to its own (they return the update and carry AF2's module config).
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from gated_attention import alphafold

# AF2's class names in alphafold.model.modules, and ours that replace them.
FAMILY = {
    "MSARowAttentionWithPairBias": alphafold.MSARowAttentionWithPairBias,
    "MSAColumnAttention": alphafold.MSAColumnAttention,
    "MSAColumnGlobalAttention": alphafold.MSAColumnGlobalAttention,
    "TriangleAttention": alphafold.TriangleAttention,
}

_LOCK = threading.RLock()


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


class _Swap(contextlib.ContextDecorator):
    """Context manager and decorator: AF2's attention classes replaced while it is active."""

    def __init__(self, replacements: Mapping[str, Any] | None, target: ModuleType | None):
        replacements = dict(FAMILY if replacements is None else replacements)
        unknown = sorted(set(replacements) - set(FAMILY))
        if unknown:
            raise ValueError(
                f"replacements names {unknown}, which are not AF2 attention modules; expected "
                f"keys among {sorted(FAMILY)}"
            )
        self._replacements = replacements
        self._target = target
        self._saved: list[dict[str, Any]] = []

    def __enter__(self) -> ModuleType:
        _LOCK.acquire()
        target = self._target or alphafold_modules()
        missing = [name for name in self._replacements if not hasattr(target, name)]
        if missing:
            _LOCK.release()
            raise AttributeError(
                f"{target.__name__} has no {missing}: not an AlphaFold 2 modules.py this "
                "integration knows (tested with alphafold-colabfold 2.3.27)"
            )
        self._saved.append({name: getattr(target, name) for name in self._replacements})
        for name, cls in self._replacements.items():
            setattr(target, name, cls)
        return target

    def __exit__(self, *exc) -> None:
        target = self._target or alphafold_modules()
        try:
            for name, cls in self._saved.pop().items():
                setattr(target, name, cls)
        finally:
            _LOCK.release()


def use_gated_attention(
    replacements: Mapping[str, Any] | None = None, *, target: ModuleType | None = None
) -> _Swap:
    """AF2's attention modules replaced by this library's, as a context manager or a decorator.

    Args:
      replacements: AF2 class name -> module class; None: all four of FAMILY. A subset swaps only
        those (e.g. {"TriangleAttention": ga.TriangleAttention}).
      target: the modules.py to patch; None: alphafold.model.modules (imported on entry).

    Returns:
      A reusable, re-entrant context manager (entering it returns the patched module) that is
      also a decorator: the swap holds while the decorated function runs.
    """
    return _Swap(replacements, target)
