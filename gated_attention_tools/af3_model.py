"""AlphaFold 3's network modules (alphafold3-colabfold, Python >= 3.12) for the tests and the AF3
measurements, imported with empty chemical-component tables where the package has none.

AF3 reads its chemical-component tables when `alphafold3.constants` is imported; its `build_data`
builds them from the wwPDB's component dictionary, a download. The trunk's blocks read no
component, so where the installed package has no tables, AF3's resources root points, while its
modules are imported, at a temporary folder holding an empty
`constants/converters/chemical_component_sets.pickle` (no glycans), and is restored and the folder
removed afterwards (AF3 reads the sets once, at import). Nothing is written into the installed
package; one that has its tables uses them. Users build the real tables (docs/alphafold3.md)."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import pathlib
import pickle
import tempfile
import types

from gated_attention.af3.swap import TABLES as SETS  # where AF3 reads its component sets

MODULES = (
    "alphafold3.model.model_config",
    "alphafold3.model.network.modules",
    "alphafold3.model.network.evoformer",
    "alphafold3.model.network.template_modules",
    "alphafold3.model.network.diffusion_transformer",
    "alphafold3.model.network.diffusion_head",
    "alphafold3.model.components.attention",
    "alphafold3.model.components.utils",
)


def installed() -> bool:
    return importlib.util.find_spec("alphafold3") is not None


@functools.cache
def load() -> types.SimpleNamespace:
    """AF3's modules by their last name (modules, evoformer, attention, ...)."""
    from alphafold3.common import resources

    root = resources.ROOT
    with tempfile.TemporaryDirectory(prefix="af3_tables_") as folder:
        if not pathlib.Path(resources.filename(root / SETS)).exists():
            tables = pathlib.Path(folder)
            (tables / SETS).parent.mkdir(parents=True)
            empty = {"glycans_linking": frozenset(), "glycans_other": frozenset()}
            (tables / SETS).write_bytes(pickle.dumps(empty))
            resources.ROOT = tables
        try:
            loaded = {name.rsplit(".", 1)[1]: importlib.import_module(name) for name in MODULES}
        finally:
            resources.ROOT = root
    return types.SimpleNamespace(**loaded)
