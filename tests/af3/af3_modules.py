"""AlphaFold 3's network modules for the tests, or a skip where the package is absent.

AF3 (the alphafold3-colabfold package, Python >= 3.12) reads its chemical-component tables when
`alphafold3.constants` is imported; its `build_data` builds them from the wwPDB's component
dictionary, a download. None of the modules tested here reads a component, so where the
installed package has no tables the tests supply empty ones: while AF3's modules are imported,
its resources root points at a temporary folder holding an empty
`constants/converters/chemical_component_sets.pickle` (no glycans), and is restored afterwards.
Nothing is written into the installed package; one that has its tables uses them."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import pathlib
import pickle
import tempfile
import types

import pytest

REASON = "needs alphafold3-colabfold (Python >= 3.12: pip install -e '.[test]' on that stack)"
SETS = "constants/converters/chemical_component_sets.pickle"
MODULES = (
    "alphafold3.model.model_config",
    "alphafold3.model.network.modules",
    "alphafold3.model.network.evoformer",
    "alphafold3.model.network.template_modules",
    "alphafold3.model.network.diffusion_transformer",
    "alphafold3.model.components.attention",
    "alphafold3.model.components.utils",
)


def installed() -> bool:
    return importlib.util.find_spec("alphafold3") is not None


@functools.cache
def load() -> types.SimpleNamespace:
    """AF3's modules by their last name (modules, evoformer, ...), imported with empty
    chemical-component tables where the package has none; a pytest skip where AF3 is absent."""
    if not installed():
        pytest.skip(REASON)
    from alphafold3.common import resources

    root = resources.ROOT
    if not pathlib.Path(resources.filename(root / SETS)).exists():
        tables = pathlib.Path(tempfile.mkdtemp(prefix="af3_tables_"))
        (tables / SETS).parent.mkdir(parents=True)
        empty = {"glycans_linking": frozenset(), "glycans_other": frozenset()}
        (tables / SETS).write_bytes(pickle.dumps(empty))
        resources.ROOT = tables
    try:
        loaded = {name.rsplit(".", 1)[1]: importlib.import_module(name) for name in MODULES}
    finally:
        resources.ROOT = root
    return types.SimpleNamespace(**loaded)
