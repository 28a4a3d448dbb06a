"""ColabDesign on the JAX this library needs (>= 0.10), with nothing of JAX changed.

ColabDesign's design code calls JAX names that newer releases removed: its repository's 1.1.3
(what BindCraft installs) calls `jnp.clip(x, a_min=, a_max=)` three times in its AF2
(`modules.py` once, `modules_multimer.py` twice) and `jax.lib.xla_bridge.get_backend()` in
`clear_mem`; the registry's 1.1.1 also calls `jax.tree_map`, `jax.tree_flatten` and
`jax.tree_unflatten` throughout and `jax.util.wraps` in `mapping.py`. `adapt_colabdesign()` gives
each loaded `colabdesign` module its own `jax` and `jnp` names: views of JAX's modules that answer
these old names with the current functions (jax.tree_util's, jnp.clip's `min`/`max`,
jax.extend.backend's `get_backend`) and pass every other name through. JAX itself, and every other
module's `jax` and `jnp`, are untouched: jax.numpy.clip still refuses `a_min`.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import threading
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp

# The subpackages a design step runs (mk_afdesign_model, its AF2, losses and optimiser).
DESIGN_MODULES = ("colabdesign.af", "colabdesign.shared.model", "colabdesign.shared.utils")

_LOCK = threading.Lock()


def _clip(a, a_min=None, a_max=None, *, min=None, max=None):  # noqa: A002 (jnp.clip's names)
    """jnp.clip with its removed a_min/a_max keywords (ColabDesign's calls) as min/max."""
    if a_min is not None and min is not None or a_max is not None and max is not None:
        raise TypeError("clip got both a_min and min (or a_max and max); pass one of each")
    return jnp.clip(a, a_min if min is None else min, a_max if max is None else max)


def _wraps(wrapped, namestr=None, docstr=None, **kwargs):
    """jax.util.wraps (removed): functools.wraps, with its docstring template filled in."""
    del namestr, kwargs

    def decorate(fun):
        fun = functools.wraps(wrapped)(fun)
        if docstr is not None:
            name = getattr(wrapped, "__name__", "function")
            fun.__doc__ = docstr.format(fun=name, doc=wrapped.__doc__ or "")
        return fun

    return decorate


class _View(ModuleType):
    """A module that answers `extra`'s names itself and every other name from `base`."""

    def __init__(self, name: str, base: ModuleType | None, extra: dict[str, Any]):
        super().__init__(name, getattr(base, "__doc__", None))
        self._base = base
        self.__dict__.update(extra)

    def __getattr__(self, name: str) -> Any:
        if self._base is None:
            raise AttributeError(f"{self.__name__} has no {name!r}")
        return getattr(self._base, name)


def _get_backend(platform=None):
    """jax.lib.xla_bridge.get_backend (removed): jax.extend.backend's."""
    from jax.extend import backend

    return backend.get_backend(platform)


@functools.cache  # built on first use: nothing of it runs at `import gated_attention`
def _views() -> tuple[_View, _View]:
    """(jax, jax.numpy) as ColabDesign's modules see them."""
    xla_bridge = _View("jax.lib.xla_bridge", None, dict(get_backend=_get_backend))
    tree = jax.tree_util
    jax_view = _View(
        "jax",
        jax,
        dict(
            tree_map=tree.tree_map,
            tree_flatten=tree.tree_flatten,
            tree_unflatten=tree.tree_unflatten,
            tree_leaves=tree.tree_leaves,
            tree_structure=tree.tree_structure,
            util=_View("jax.util", None, dict(wraps=_wraps)),
            lib=_View("jax.lib", getattr(jax, "lib", None), dict(xla_bridge=xla_bridge)),
        ),
    )
    return jax_view, _View("jax.numpy", jnp, dict(clip=_clip))


def _keep_xla_flags(before: str | None) -> None:
    """ColabDesign's `import colabdesign` sets XLA_FLAGS to its own flag alone (turning Triton
    GEMMs off on GPUs), dropping the process's: keep those, with its flag added."""
    after = os.environ.get("XLA_FLAGS")
    if before is None or after == before:
        return
    added = [] if after is None else [f for f in after.split() if f not in before.split()]
    os.environ["XLA_FLAGS"] = " ".join([before, *added])


def import_colabdesign(name: str) -> ModuleType:
    """importlib.import_module(name) of a ColabDesign module, the process's XLA_FLAGS kept
    (_keep_xla_flags), or an ImportError saying how to install ColabDesign."""
    flags = os.environ.get("XLA_FLAGS")
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ImportError(
            "ColabDesign is not installed: pip install colabdesign (1.1.1), or ColabDesign's "
            f"repository as BindCraft installs it (1.1.3); importing {name} failed with: {e}"
        ) from e
    finally:
        _keep_xla_flags(flags)


def adapt_colabdesign() -> list[str]:
    """Lets ColabDesign (1.1.1 or 1.1.3) run its design steps on this JAX: imports DESIGN_MODULES
    and rebinds `jax` and `jnp` in every loaded `colabdesign` module to this module's views.
    Idempotent; call it before importing ColabDesign (its import would otherwise replace the
    process's XLA_FLAGS with its own flag: here the flags are kept, its flag added) and again
    after importing a ColabDesign module that DESIGN_MODULES do not import.

    Returns:
      The names of the modules rebound by this call (empty when all already were).

    Raises:
      ImportError: ColabDesign is not installed (with the command that installs it).
    """
    for name in DESIGN_MODULES:
        import_colabdesign(name)
    rebound, (jax_view, jnp_view) = [], _views()
    with _LOCK:
        for name, module in sorted(sys.modules.items()):
            if module is None or not (name == "colabdesign" or name.startswith("colabdesign.")):
                continue
            changed = False
            for attr, real, view in (("jax", jax, jax_view), ("jnp", jnp, jnp_view)):
                if getattr(module, attr, None) is real:
                    setattr(module, attr, view)
                    changed = True
            if changed:
                rebound.append(name)
    return rebound
