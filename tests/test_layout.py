"""The package's shape: its folders are its layers, lowest first

  core/       checks, numerics, masks, platforms, memory estimates, the JAX compatibility seam
  parallel/   many devices and row loops (sharding, the row loop, ring attention)
  attention/  the op: api (entry) over dispatch over the implementations, each kernel family a
              folder of the same roles (implementation, plan, kernels, and a pipeline or tile table)
  af2/        the Haiku modules, AlphaFold 2's family, parameters, configs and package
  af3/        AlphaFold 3's own model (alphafold3-colabfold) on the op: the swap of its attention

and a module imports its own folder and those below, never one above; a kernel family imports no
other family, so either can be removed by deleting its folder and its registry line. Files are of
one idea (none over 600 lines) and functions short (none over 80 lines, docstring aside)."""

from __future__ import annotations

import ast
import pathlib

import pytest

import gated_attention

PACKAGE = pathlib.Path(gated_attention.__file__).parent
MAX_LINES = 600
MAX_FUNCTION_LINES = 80
LAYERS = ("core", "parallel", "attention", "af2", "af3")  # lowest first
FAMILIES = ("xla_chunked", "pallas_triton", "pallas_mosaic_gpu", "pallas_mosaic_tpu")
# The op's entry, above its implementations: and the tuning candidates, named from its registry.
ENTRY = ("attention.api", "attention.dispatch", "attention.candidates")
ROLES = ("implementation.py", "plan.py")  # and kernels*.py, in every family folder


def _name(path: pathlib.Path) -> str:
    """gated_attention/attention/pallas_triton/plan.py -> 'attention.pallas_triton.plan'."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = sorted(PACKAGE.rglob("*.py"))
NAMES = {_name(p) for p in MODULES}


def _layer(name: str) -> int:
    top = name.split(".")[0]
    if name == "":  # the package's __init__: above every layer
        return len(LAYERS)
    assert top in LAYERS, f"gated_attention/{name} is in no layer folder of tests/test_layout.py"
    return LAYERS.index(top)


def _family(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 2 and parts[0] == "attention" and parts[1] in FAMILIES else None


def _imports(path: pathlib.Path) -> set[str]:
    """The gated_attention modules a file imports (names relative to the package)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gated_attention"):
            base = node.module.removeprefix("gated_attention").removeprefix(".")
            for alias in node.names:
                full = f"{base}.{alias.name}" if base else alias.name
                found.add(full if full in NAMES else base)
        elif isinstance(node, ast.Import):
            found |= {
                a.name.removeprefix("gated_attention.")
                for a in node.names
                if a.name.startswith("gated_attention.")
            }
    return found - {""}


def test_every_folder_is_a_layer_and_every_family_has_the_roles():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(LAYERS), folders
    flat = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert flat == ["__init__.py"], f"modules outside a layer folder: {flat}"
    for family in FAMILIES:
        files = {p.name for p in (PACKAGE / "attention" / family).glob("*.py")}
        missing = [r for r in ROLES if r not in files]
        kernels = [f for f in files if f.startswith("kernels")]
        assert not missing and kernels, f"attention/{family}/ lacks {missing or 'kernels*.py'}"


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_files_of_one_idea(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.name} has {lines} lines, over {MAX_LINES}: split it"


def _long_functions(source: str) -> list[str]:
    long = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            doc = node.body[0]
            if isinstance(doc, ast.Expr) and isinstance(getattr(doc, "value", None), ast.Constant):
                lines -= doc.end_lineno - doc.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                long.append(f"{node.name} (line {node.lineno}): {lines} lines")
    return long


def test_the_function_rule_counts_code_not_docstrings():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES - 1))
    doc = '    """' + "\n" * 30 + '    """\n'
    assert _long_functions(f"def f():\n{doc}{body}\n") == []
    assert _long_functions(f"def f():\n{body}\n    return x0\n") == [
        f"f (line 1): {MAX_FUNCTION_LINES + 1} lines"
    ]


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_functions_are_short(path):
    long = _long_functions(path.read_text())
    assert not long, f"{_name(path)}: split into named steps: {long}"


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_imports_point_down(path):
    own = _name(path)
    climbs = sorted(m for m in _imports(path) if _layer(m) > _layer(own))
    assert not climbs, f"{own} ({LAYERS[_layer(own)] if own else 'package'}) imports {climbs}"


@pytest.mark.parametrize(
    "path", [p for p in MODULES if _name(p).startswith("attention.")], ids=_name
)
def test_the_op_imports_its_implementations_never_the_reverse(path):
    """Inside attention/: api and dispatch import the implementations; a family imports its own
    folder and the shared modules (base, gpu_common), never another family nor the entry."""
    own = _name(path)
    if own in ENTRY:
        return
    wrong = sorted(
        m
        for m in _imports(path)
        if m in ENTRY or (_family(m) is not None and _family(m) != _family(own))
    )
    assert not wrong, f"{own} imports {wrong}"


def test_the_rules_see_a_planted_climb(tmp_path):
    """The import reader resolves `from gated_attention.x import module` to the module."""
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from gated_attention.attention import api\n"
        "from gated_attention.attention.pallas_triton import plan\n"
        "from gated_attention.core.checks import check_int\n"
    )
    got = _imports(planted)
    assert got == {"attention.api", "attention.pallas_triton.plan", "core.checks"}
    assert _layer("attention.api") > _layer("core.checks")
    assert _family("attention.pallas_triton.plan") == "pallas_triton"


def test_the_tests_mirror_the_folders():
    """tests/<layer>/ for each layer folder, and a test module per kernel family."""
    tests = pathlib.Path(__file__).parent
    assert all((tests / layer / "__init__.py").is_file() for layer in LAYERS)
    missing = [f for f in FAMILIES if not (tests / "attention" / f"test_{f}.py").is_file()]
    assert not missing, f"no tests/attention/test_<family>.py for {missing}"


def test_the_wheel_is_the_library_alone(monkeypatch):
    """setup.py's packages are every package folder of gated_attention/ and nothing else (the
    tooling, scripts, configs and tests run from a checkout), its package data theirs."""
    import runpy

    import setuptools

    got = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: got.update(kwargs))
    monkeypatch.chdir(PACKAGE.parent)
    runpy.run_path(str(PACKAGE.parent / "setup.py"))
    folders = {
        ".".join(p.parent.relative_to(PACKAGE.parent).parts) for p in PACKAGE.rglob("__init__.py")
    }
    assert set(got["packages"]) == folders, sorted(set(got["packages"]) ^ folders)
    assert set(got["package_data"]) <= folders, got["package_data"]
    for package, patterns in got["package_data"].items():
        folder = PACKAGE.parent.joinpath(*package.split("."))
        assert all(list(folder.glob(p)) for p in patterns), (package, patterns)


def test_the_long_tests_name_tests():
    """Each prefix of tests/conftest.py's LONG_TESTS (run first, dealt over the workers) names a
    test module's function or class method (a renamed test is not silently dropped)."""
    import importlib

    from tests.conftest import LONG_TESTS

    stale = []
    for prefix in LONG_TESTS:
        path, *names = prefix.split("::")
        obj = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        for name in names:
            name = name.partition("[")[0]
            matches = [n for n in dir(obj) if n == name or n.startswith(name) and name == names[-1]]
            obj = getattr(obj, matches[0]) if matches else None
            if obj is None:
                stale.append(prefix)
                break
    assert not stale, stale


def test_the_test_processes_compile_level_stays_out_of_the_childrens_flags():
    """tests/conftest.py has this process compile at LLVM -O0 (with no GPU or TPU here) and takes
    the flag out of XLA_FLAGS once the backend has started: the children the tests start (GPU and
    TPU compiles, whose ptxas reads the level too; the scripts) inherit XLA_FLAGS and must compile
    as users do."""
    import os

    assert "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"], os.environ["XLA_FLAGS"]
