"""The package's shape: files of one idea (none over 600 lines) and layers that only point down
(the model-facing modules over the op, the op over its implementations, those over the shared
pieces); a new module must be placed in a layer here."""

from __future__ import annotations

import ast
import pathlib

import pytest

import gated_attention

PACKAGE = pathlib.Path(gated_attention.__file__).parent
MAX_LINES = 600

# Lowest first: a module may import its own layer and those below it, never one above.
LAYERS = {
    "shared": {
        "archive", "base", "checks", "compat", "mapping", "masking", "memory", "numerics",
        "gpu_common", "platforms", "sharding", "tuning",
    },
    "implementations": {"chunked", "cudnn", "per_mode", "ring", "xla"},
    "op": {"attention"},
    "models": {
        "__init__", "af2_package", "alphafold", "config", "dropout", "modules", "pair_bias",
        "params",
    },
}  # fmt: skip
# Each kernel family's own modules sit beside it.
FAMILIES = ("chunked_", "mosaic", "pallas")


def _layer(module: str) -> int:
    names = list(LAYERS)
    if module.startswith(FAMILIES):
        return names.index("implementations")
    for index, name in enumerate(names):
        if module in LAYERS[name]:
            return index
    raise AssertionError(f"gated_attention/{module}.py is in no layer of tests/test_layout.py")


def _imports(path: pathlib.Path) -> set[str]:
    """The gated_attention modules a file imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "gated_attention":
                found |= {alias.name for alias in node.names}
            elif node.module.startswith("gated_attention."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {
                a.name.split(".")[1] for a in node.names if a.name.startswith("gated_attention.")
            }
    return found


MODULES = sorted(PACKAGE.glob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.stem)
def test_files_of_one_idea(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.name} has {lines} lines, over {MAX_LINES}: split it"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.stem)
def test_imports_point_down(path):
    own = _layer(path.stem)
    climbs = sorted(m for m in _imports(path) if _layer(m) > own)
    assert not climbs, f"{path.name} ({list(LAYERS)[own]}) imports from above: {climbs}"


def test_neither_gpu_kernel_family_imports_the_other():
    """The rules both GPU kernels follow live in gpu_common.py: the Mosaic GPU family (mosaic*.py)
    imports no module of the Triton one (pallas*.py but pallas_tpu*, the deprecated backend's)
    and the reverse, so either can be removed by deleting its modules and its registry line."""

    def family(stem: str) -> str | None:
        if stem.startswith("mosaic"):
            return "mosaic"
        return "pallas" if stem.startswith("pallas") and not stem.startswith("pallas_tpu") else None

    crossed = []
    for path in sorted(PACKAGE.glob("*.py")):
        own = family(path.stem)
        if own is None:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith(
                "gated_attention"
            ):
                continue
            stems = [a.name for a in node.names] if node.module == "gated_attention" else []
            stems.append(node.module.split(".")[-1])
            crossed += [f"{path.name}: {s}" for s in stems if family(s) not in (None, own)]
    assert not crossed, crossed
