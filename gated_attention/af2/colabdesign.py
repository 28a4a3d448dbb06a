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

import functools
import threading
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import jax
import numpy as np

from gated_attention.af2 import af2_package
from gated_attention.af2.colabdesign_jax import (
    DESIGN_MODULES,
    adapt_colabdesign,
    import_colabdesign,
)

__all__ = [
    "DESIGN_MODULES",
    "adapt_colabdesign",
    "param_shapes",
    "random_params",
    "step_arguments",
    "use_gated_attention",
]

MODULES = "colabdesign.af.alphafold.model.modules"
_CAPTURE_LOCK = threading.Lock()  # random_params swaps a runner's apply for one call


def colabdesign_modules() -> ModuleType:
    """ColabDesign's AF2 modules.py (imported keeping XLA_FLAGS: colabdesign_jax), or an
    ImportError saying how to install ColabDesign."""
    return import_colabdesign(MODULES)


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
    """Stops ColabDesign's design step once what a stand-in was after is known."""


def _run_until(model: Any, owner: Any, name: str, take: Any, model_params: Any = None) -> Any:
    """ColabDesign's design step (model._recycle, as run() calls it, on `model_params`) with
    owner's `name` (an attribute, or a key of a dict) replaced by a stand-in that records
    take(*args) and stops the step there; owner restored after. Returns what take returned."""
    found = {}

    def stand_in(*args):
        found["value"] = take(*args)
        raise _CapturedError

    put = owner.__setitem__ if isinstance(owner, dict) else functools.partial(setattr, owner)
    with _CAPTURE_LOCK:
        original = owner[name] if isinstance(owner, dict) else getattr(owner, name)
        put(name, stand_in)
        try:
            model._inputs["opt"] = model.opt
            # The gradient's function: over 384 residues ColabDesign's inference one has another
            # runner (its subbatched AF2), which a stand-in for the runner's apply would miss.
            model._recycle({} if model_params is None else model_params, backprop=True)
        except _CapturedError:
            pass
        finally:
            put(name, original)
    return found["value"]


def _check_prepared(model: Any) -> None:
    if not isinstance(getattr(model, "_model", None), dict) or "runner" not in model._model:
        raise ValueError(
            f"model must be a ColabDesign model after prep_inputs (mk_afdesign_model(...)."
            f"prep_inputs(...)); got {type(model).__name__} without a prepared model"
        )


def param_shapes(model: Any) -> dict[str, dict[str, jax.ShapeDtypeStruct]]:
    """The parameters' shapes of a ColabDesign model after `prep_inputs`: its AF2 traced once on
    its prepared inputs (jax.eval_shape of its runner's init, nothing computed)."""
    _check_prepared(model)
    runner = model._model["runner"]
    take = lambda params, key, feat: jax.eval_shape(runner.init, key, feat)
    return _run_until(model, runner, "apply", take)


def step_arguments(model: Any, model_params: Any) -> tuple:
    """The arguments ColabDesign's `run` passes its jitted design step (`model._model
    ["grad_fn"]`: the design parameters, the model's parameters, the inputs with the options and
    the recycled state, a key), for `model_params` (arrays or their shapes, param_shapes), from
    `restart(seed=0)`; nothing traced. Python scalars among them as NumPy arrays (jax.jit traces
    them alike). With them the step compiles for a GPU without one (jax.jit(...).lower)."""
    _check_prepared(model)
    model.restart(seed=0)
    args = _run_until(model, model._model, "grad_fn", lambda *args: args, model_params)
    as_array = lambda x: x if isinstance(x, jax.ShapeDtypeStruct) else np.asarray(x)
    return jax.tree_util.tree_map(as_array, args)


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
