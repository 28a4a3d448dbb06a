"""ColabDesign's AlphaFold 2 (and so BindCraft's) running this library's attention.

ColabDesign (`colabdesign`) designs proteins by taking gradients through its own copy of AF2,
`colabdesign.af.alphafold.model.modules`, whose multimer model (`modules_multimer`) looks its
attention classes up in `modules` too. Inside `use_gated_attention()` that module builds this
library's attention wherever it builds attention: MSA row and column attention, MSA column global
attention and triangle attention in the main, extra-MSA and template stacks, and `Attention` and
`GlobalAttention` themselves, on ColabDesign's parameters and call signatures (no `is_training`;
its dropout stays its own). It is af2_package's swap on ColabDesign's modules.py, so it has that
swap's guarantees: it holds in the entering thread only, jax.jit traces a function again under
another swap, and nothing changes outside it. ColabDesign's jitted design step, built by
`prep_inputs`, is traced again on its first call inside the swap:

    import gated_attention as ga
    ga.colabdesign.adapt_colabdesign()   # ColabDesign on jax >= 0.10 (colabdesign_jax)
    from colabdesign import mk_afdesign_model

    model = mk_afdesign_model(protocol="binder")   # as BindCraft builds it
    model.prep_inputs(pdb_filename="target.pdb", chain="A", binder_len=60)
    with ga.colabdesign.use_gated_attention():
        model.design_3stage(100, 100, 10)           # every step with this attention

`random_params(model)` draws a parameter set in ColabDesign's layout for trying this without AF2's
weights (which ColabDesign reads from `data_dir`, as `params/params_<model>.npz`).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import jax
import numpy as np

from gated_attention.af2 import af2_package
from gated_attention.af2.colabdesign_jax import DESIGN_MODULES, adapt_colabdesign

__all__ = ["DESIGN_MODULES", "adapt_colabdesign", "random_params", "use_gated_attention"]

MODULES = "colabdesign.af.alphafold.model.modules"
_CAPTURE_LOCK = threading.Lock()  # random_params swaps a runner's apply for one call


def colabdesign_modules() -> ModuleType:
    """ColabDesign's AF2 modules.py, or an ImportError saying how to install ColabDesign."""
    try:
        return importlib.import_module(MODULES)
    except ImportError as e:
        raise ImportError(
            "ColabDesign is not installed: pip install colabdesign (1.1.1), or ColabDesign's "
            f"repository as BindCraft installs it (1.1.3); import failed with: {e}"
        ) from e


def use_gated_attention(
    replacements: Mapping[str, Any] | None = None, *, layouts: bool = True
) -> af2_package._Swap:
    """ColabDesign's AF2 attention modules replaced by this library's, as a context manager or a
    decorator (af2_package.use_gated_attention on ColabDesign's modules.py).

    Args:
      replacements: AF2 class name -> module class; None: all of af2_package.REPLACEMENTS.
      layouts: also AF2's TriangleMultiplication and OuterProductMean with DAP's layouts, which
        act only when global_config.shard_rows_over splits the rows over devices.

    Returns:
      A reusable, re-entrant context manager and decorator; entering it returns the module.
    """
    return af2_package._Swap(replacements, None, layouts, load=colabdesign_modules)


class _CapturedError(Exception):
    """Stops ColabDesign's model once its parameters' shapes are known."""


def param_shapes(model: Any) -> dict[str, dict[str, jax.ShapeDtypeStruct]]:
    """The parameters' shapes of a ColabDesign model after `prep_inputs`: its AF2 traced once on
    its prepared inputs (jax.eval_shape of its runner's init, nothing computed)."""
    if not hasattr(model, "_model") or "runner" not in getattr(model, "_model", {}):
        raise ValueError(
            f"model must be a ColabDesign model after prep_inputs (mk_afdesign_model(...)."
            f"prep_inputs(...)); got {type(model).__name__} without a prepared model"
        )
    runner, found = model._model["runner"], {}

    def capture(params, key, feat):
        del params
        found["shapes"] = jax.eval_shape(runner.init, key, feat)
        raise _CapturedError

    with _CAPTURE_LOCK:
        apply, runner.apply = runner.apply, capture
        try:
            model._inputs["opt"] = model.opt
            # The gradient's function: over 384 residues ColabDesign's inference one has another
            # runner (its subbatched AF2), whose apply this would not reach.
            model._recycle({}, backprop=True)
        except _CapturedError:
            pass
        finally:
            runner.apply = apply
    return found["shapes"]


def random_params(model: Any, seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
    """Parameters for a ColabDesign model with every weight drawn, AF2's zero-initialised last
    layers included (with them zero every attention gives the same loss): weights normal with
    standard deviation 1/sqrt(fan-in), LayerNorm scales 1 + 0.1 N(0, 1), other vectors 0.1 N(0, 1).
    For trying the integration and for tests, not for design: use AF2's weights for that.

    Args:
      model: a ColabDesign model after prep_inputs.
      seed: the NumPy generator's seed.

    Returns:
      {scope: {name: array}} in ColabDesign's layout: `model._model_params = [params]`.
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {seed!r}")
    rng = np.random.default_rng(seed)
    params = {}
    for scope, leaves in param_shapes(model).items():
        params[scope] = {name: _draw(rng, name, leaf) for name, leaf in leaves.items()}
    return params


def _draw(rng: np.random.Generator, name: str, leaf: jax.ShapeDtypeStruct) -> np.ndarray:
    """One parameter: see random_params. output_w [h, c, o] takes h * c inputs, others shape[0]."""
    shape = tuple(leaf.shape)
    if len(shape) >= 2:
        fan_in = int(np.prod(shape[:-1])) if name == "output_w" else shape[0]
        value = rng.normal(size=shape) / np.sqrt(fan_in)
    elif "scale" in name:
        value = 1.0 + 0.1 * rng.normal(size=shape)
    else:
        value = 0.1 * rng.normal(size=shape)
    return value.astype(leaf.dtype)
