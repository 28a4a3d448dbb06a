"""AlphaFold 3's own model (the `alphafold3-colabfold` package) running this library's attention.

AF3's pair attention (the triangle attention of PairFormerIteration, of the template stack and of
the MSA stack's EvoformerIteration) calls one function when a block is traced:
`alphafold3.model.components.attention.dot_product_attention(q, k, v, *, mask, bias,
implementation, scale)`, tokamax's signature and layout (q, k, v [..., T, N, H]; bias [..., N, T,
S]; a bool mask broadcast likewise), which hands the call to `tokamax.dot_product_attention`
(upstream AF3 calls tokamax's directly). Inside `use_gated_attention()` both names are this
library's `dot_product_attention`, the layout and arguments being jax.nn's already, so AF3's
modules, parameters and configs stay AF3's:

    from alphafold3.model.network import modules
    import gated_attention as ga

    @ga.af3.use_gated_attention()        # or: with ga.af3.use_gated_attention():
    def trunk_block(pair, pair_mask, single, seq_mask):
        block = modules.PairFormerIteration(
            config, global_config, with_single=True, name="trunk_pairformer"
        )
        return block(pair, pair_mask, single_act=single, seq_mask=seq_mask)

    fn = hk.transform(trunk_block)          # traced inside the decorator: AF3 with our attention

AF3 names its implementation in global_config.flash_attention_implementation ('triton', 'cudnn',
'xla', this package's 'pallas' and 'volta', or None). By default every call goes to our 'auto'
(the best implementation for the device, whatever AF3 asked for); implementation='af3' maps AF3's
name to ours (AF3_NAMES); any other value (a name of gated_attention.IMPLEMENTATIONS, an
implementation instance, a priority sequence) is used for every call.

The swap lasts while the decorated function runs (which is when hk.transform and jax.jit trace it),
as af2_package's: on first use each entry point becomes a dispatcher that calls AF3's function or
ours by the swap active in the calling thread (a JAX config state, thread-local and part of jax.jit's
trace context), so another thread meanwhile, and code outside the swap, get AF3's attention, and a
function jitted on one side of the swap is traced again on the other, never served from the cache.
AF3's inline self attention (diffusion_transformer.self_attention, which the single and diffusion
transformers call) is swapped with inline=True (inline.py; opt-in, use_gated_attention says
why); the atom transformers' cross_attention stays AF3's.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import pathlib
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from gated_attention.af3 import inline as inline_attention
from gated_attention.attention import api
from gated_attention.core import compat

# The functions the swap replaces: module -> attribute. The package's own function comes first
# (AF3's modules import it by name at trace time); tokamax's is what upstream AF3 calls.
ENTRY_POINTS = (
    ("alphafold3.model.components.attention", "dot_product_attention"),
    ("tokamax", "dot_product_attention"),
)
# AF3's inline attention (the single and diffusion transformers'): inline.py's function.
INLINE = (("alphafold3.model.network.diffusion_transformer", "self_attention"),)
TESTED_WITH = "alphafold3-colabfold==3.1.18"
# AF3's chemical-component sets, read when its modules are first imported (relative to its root).
TABLES = "constants/converters/chemical_component_sets.pickle"
BUILD_TABLES = (
    "curl -L https://files.wwpdb.org/pub/pdb/data/monomers/components.cif.gz | gunzip > "
    "components.cif && LIBCIFPP_DATA_DIR=$PWD build_data"
)

# implementation='af3': AF3's name for its attention -> ours. 'volta' (ColabFold's Volta/Turing
# kernel) has no counterpart here: 'auto' picks what the device runs.
AF3_NAMES: dict[str | None, str] = {
    None: "auto",
    "xla": "xla",
    "triton": "pallas",
    "pallas": "pallas",
    "cudnn": "cudnn",
    "volta": "auto",
}
MODES = ("auto", "af3")  # implementation's own words; anything else is passed to our op

_LOCK = threading.Lock()  # guards installing the dispatchers, never held by a swap
_ACTIVE = compat.trace_context_state(
    "gated_attention_af3_swap",
    None,
    "The gated_attention AF3 swap active in this thread (af3.use_gated_attention).",
)
# key -> (the implementation argument of that swap, the entry points it answers)
_SWAPS: dict[str, tuple[Any, frozenset]] = {}
_ORIGINAL = "gated_attention_af3_original"  # a dispatcher's attribute: the function it stands for
# Set while a dispatcher answers a call: our op's own call to tokamax (the tokamax_* peers) is
# then tokamax's, not answered again (it recursed without end).
_ANSWERING = threading.local()


def af3_implementation(name: Any, implementation: Any = "af3") -> Any:
    """Our implementation for a call in which AF3 asked for `name`.

    Args:
      name: AF3's implementation argument, a key of AF3_NAMES.
      implementation: the swap's setting: 'af3' (AF3_NAMES), 'auto', or our implementation
        argument used as it is.

    Returns:
      The implementation argument for gated_attention.dot_product_attention.
    """
    if name not in AF3_NAMES:
        raise ValueError(
            f"AF3 asked for implementation={name!r}, which this swap does not know; expected one "
            f"of {sorted(AF3_NAMES, key=str)} (AF3's global_config.flash_attention_implementation)"
        )
    if implementation == "af3":
        return AF3_NAMES[name]
    return implementation


def attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    implementation: Any = None,
    swap_implementation: Any = "auto",
    **kwargs,
):
    """AF3's (and tokamax's) dot_product_attention call answered by ours.

    Args:
      query, key, value: [..., T, N, H], [..., S, K, H], [..., S, K, Hv] (tokamax's layout, which
        is ours).
      bias: None or a float array broadcastable to [..., N, T, S].
      mask: None or a bool array broadcastable to [..., N, T, S]; False = masked.
      implementation: AF3's name (AF3_NAMES' keys).
      swap_implementation: the swap's setting (af3_implementation).
      **kwargs: the rest of tokamax's keyword arguments (scale, is_causal, ...), passed on.

    Returns:
      [..., T, N, Hv] in query's dtype.
    """
    ours = af3_implementation(implementation, swap_implementation)
    return api.dot_product_attention(query, key, value, bias, mask, implementation=ours, **kwargs)


def _inline(
    original: Callable, setting: Any, x, mask, pair_logits, config, global_config, *a, **kw
):
    """AF3's inline self_attention answered by inline.py's, with the swap's implementation (for
    'af3': AF3's name in global_config)."""
    name = global_config.flash_attention_implementation
    implementation = af3_implementation(name, setting)
    args = (x, mask, pair_logits, config, global_config, *a)
    return inline_attention.self_attention(original, implementation, *args, **kw)


def _dispatcher(original: Callable, entry: tuple[str, str]) -> Callable:
    """A stand-in for AF3's `original` (the entry point (module name, attribute)) that calls ours
    under a swap of this entry point in this thread, else AF3's."""

    @functools.wraps(original)
    def dispatcher(*args, **kwargs):
        key = _ACTIVE.value
        if key is None or entry not in _SWAPS[key][1] or getattr(_ANSWERING, "on", False):
            return original(*args, **kwargs)
        setting = _SWAPS[key][0]
        _ANSWERING.on = True
        try:
            if entry[1] == "self_attention":
                return _inline(original, setting, *args, **kwargs)
            return attention(*args, swap_implementation=setting, **kwargs)
        finally:
            _ANSWERING.on = False

    setattr(dispatcher, _ORIGINAL, original)
    return dispatcher


def entry_module(name: str) -> ModuleType:
    """The module `name` of AF3 (or tokamax), or an ImportError saying how to install it."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ImportError(
            f"AlphaFold 3's model is not installed (Python >= 3.12): pip install "
            f"'{TESTED_WITH}' tokamax rdkit (or this package's [af3] extra); importing {name} "
            f"failed with: {e}"
        ) from e


def _install(entry_points) -> None:
    """Dispatchers in place of the entry points' functions (once per module object: a module
    imported anew, or a stand-in, gets its own)."""
    modules = [(entry_module(module), module, attr) for module, attr in entry_points]
    missing = [f"{name}.{attr}" for module, name, attr in modules if not hasattr(module, attr)]
    if missing:
        raise AttributeError(
            f"{missing} not found: not an AlphaFold 3 attention entry point this swap knows "
            f"(tested with {TESTED_WITH})"
        )
    with _LOCK:
        for module, name, attr in modules:
            function = getattr(module, attr)
            if not hasattr(function, _ORIGINAL):
                setattr(module, attr, _dispatcher(function, (name, attr)))


def original_function(module: str, attr: str = "dot_product_attention") -> Callable:
    """AF3's (tokamax's) own function, whether or not a dispatcher stands in for it."""
    function = getattr(entry_module(module), attr)
    return getattr(function, _ORIGINAL, function)


def active_implementation() -> Any:
    """The implementation setting of the swap active in this thread, or None outside a swap."""
    key = _ACTIVE.value
    return None if key is None else _SWAPS[key][0]


def check_tables() -> None:
    """FileNotFoundError saying what to run where AF3 is installed without its chemical-component
    tables, whose absence AF3's own import reports as a bare path from inside AF3. Nothing where
    AF3 is absent (entering the swap says how to install it) or its modules are imported already.
    """
    if "alphafold3.constants.chemical_component_sets" in sys.modules:
        return  # imported: AF3 found its tables (or was given others)
    if importlib.util.find_spec("alphafold3") is None:
        return
    from alphafold3.common import resources  # reads no table

    path = pathlib.Path(resources.filename(resources.ROOT / TABLES))
    if not path.exists():
        raise FileNotFoundError(
            f"AlphaFold 3 is installed without its chemical-component tables ({path} is "
            "missing), which its modules read when imported. Build them once, with AF3's own "
            "build_data from the wwPDB's component dictionary (a download; the tables go into "
            f"the installed package): {BUILD_TABLES} (docs/alphafold3.md)"
        )


def _check_implementation(implementation: Any) -> None:
    if isinstance(implementation, str) and implementation not in (*MODES, *api.IMPLEMENTATIONS):
        raise ValueError(
            f"implementation={implementation!r} is neither of {list(MODES)} nor one of ours "
            f"{sorted(api.IMPLEMENTATIONS)}"
        )


class _Swap(compat.TracedSwap):
    """Context manager and decorator: AF3's attention entry points answered by ours, in this
    thread, while it is active (the module docstring)."""

    def __init__(self, implementation: Any, entry_points):
        _check_implementation(implementation)
        self._implementation = implementation
        self._entry_points = tuple(entry_points)
        super().__init__(_ACTIVE, _SWAPS)

    def __enter__(self) -> Any:
        _install(self._entry_points)
        setting = self._implementation
        # One key per setting and entry points: jax.jit serves a trace to the same swap only.
        name = (
            setting if isinstance(setting, str) else f"{type(setting).__qualname__}@{id(setting):x}"
        )
        entries = frozenset(self._entry_points)
        key = f"af3:{name}:" + ",".join(f"{m}.{a}" for m, a in sorted(entries))
        self._activate(key, (setting, entries))
        return setting


def use_gated_attention(
    implementation: Any = "auto", *, inline: bool = False, entry_points=None
) -> _Swap:
    """AF3's pair attention answered by this library's op, as a context manager or a decorator.

    Args:
      implementation: 'auto' (default): every call to our 'auto'; 'af3': AF3's name mapped by
        AF3_NAMES; or our op's implementation argument (a name of IMPLEMENTATIONS, an
        Implementation, an Auto, a sequence), used for every call.
      inline: also AF3's inline self attention (INLINE: the single and diffusion transformers'),
        opt-in: its forward matches AF3's in float32 and bfloat16 and its float32 gradients do,
        but through the diffusion transformer its bfloat16 gradients of q and k are further
        from float32 than AF3's own, cause not found (tests/af3/test_parity.py's xfail).
      entry_points: (module name, attribute) pairs to replace; None: ENTRY_POINTS (and INLINE).

    Returns:
      A reusable, re-entrant context manager (entering it returns the implementation setting)
      that is also a decorator: the swap holds while the decorated function runs.

    Raises:
      FileNotFoundError: AF3's entry points, and AF3 installed without its chemical-component
        tables (check_tables: the message says how to build them).
    """
    if not isinstance(inline, bool):
        raise TypeError(f"inline must be a bool, got {inline!r}")
    own = entry_points is None  # AF3's own modules (stand-ins of them read no tables)
    swap = _Swap(implementation, ENTRY_POINTS + (INLINE if inline else ()) if own else entry_points)
    if own:
        check_tables()
    return swap
