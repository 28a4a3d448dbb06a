"""The documentation cannot rot: every ```python block of README.md and docs/*.md runs here, every
relative link and picture there names a file that exists, and the API reference (docs/api.md,
rendered by mkdocs + mkdocstrings, built by .ci/run with warnings as errors) lists every name in
gated_attention.__all__.

Conventions the pages follow:
* Each block runs in a fresh namespace, unless its page carries the line
  `<!-- docs-test: shared-namespace -->`: then the page's blocks run in order in one namespace, as
  a reader runs them (the page says so).
* `<!-- skip: reason -->` on the line before a block (a GPU or TPU, a download, minutes of time)
  skips it with that reason.
* `<!-- docs-test: deviceless -->` on the line before a block: it compiles for a GPU or TPU target
  without one (gated_attention_tools/targets.py), so it runs in a process of its own started as
  targets.CHILD_ENV says (JAX_PLATFORMS=cpu: the CUDA plugin registers only then); skipped where
  the `targets` extra is missing.
* `<!-- docs-test: alphafold3 -->` on the line before a block: it runs AlphaFold 3's own model
  (alphafold3-colabfold, Python >= 3.12), in a process of its own that first imports AF3's modules
  as the tests do (gated_attention_tools/af3_model.py: empty chemical-component tables where the
  package has none); skipped with that reason where AF3 is not installed (the Python 3.11 stack).
* Fences are ```python (run), ```bash / ```text (shown, never run); any other language fails
  test_fences_are_known, so that no block escapes by a typo (```py).

The blocks run as a user's script runs them: in a fresh Python process (`python -m
tests.test_docs`, one for all of them), float64 off, each group of blocks in a temporary working
directory, on the 8 CPU devices tests/conftest.py asks XLA for. That process compiles with XLA:CPU's
backend optimizations off (`--xla_backend_optimization_level=0`): the snippets' shapes are tiny, so
compiling is nearly all their time, and this makes it about 5x shorter on 2 cores. Last, that
process runs README's AF2 quick start once more with the op made wrong (_PLANTED): it must fail
its own check.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHARED = "<!-- docs-test: shared-namespace -->"
DEVICELESS = "<!-- docs-test: deviceless -->"
ALPHAFOLD3 = "<!-- docs-test: alphafold3 -->"
NEEDS_AF3 = "needs alphafold3-colabfold (Python >= 3.12: the af3 extra, in the test extra there)"
SKIP = re.compile(r"<!--\s*skip:\s*(.+?)\s*-->")  # a line of its own
FENCE = re.compile(r"^```(\S*)\s*$")
LANGUAGES = {"python", "bash", "text"}
README_MAX_LINES = 200
FAST_COMPILES = "--xla_backend_optimization_level=0"


@dataclasses.dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    language: str
    source: str
    skip: str | None  # the reason, or None
    deviceless: bool  # run in a process of its own, set up for deviceless compiles
    alphafold3: bool = False  # run in a process of its own with AF3's modules imported first

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```"), None)
        assert end is not None, f"{page.name}:{i + 1}: a fence that never closes"
        previous = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "").strip()
        skip = SKIP.fullmatch(previous)
        source = "\n".join(lines[i + 1 : end]) + "\n"
        reason, deviceless = (skip.group(1) if skip else None), previous == DEVICELESS
        af3 = previous == ALPHAFOLD3
        found.append(Block(page, i + 1, opening.group(1), source, reason, deviceless, af3))
        i = end + 1
    return found


def _python() -> list[Block]:
    return [b for page in PAGES for b in blocks(page) if b.language == "python"]


def groups() -> list[list[Block]]:
    """The blocks that run in the shared process: one group per shared page, else per block."""
    found = []
    for page in PAGES:
        runnable = [b for b in blocks(page) if b.language == "python"]
        runnable = [b for b in runnable if not (b.skip or b.deviceless or b.alphafold3)]
        if SHARED in page.read_text():
            found += [runnable] if runnable else []
        else:
            found += [[b] for b in runnable]
    return found


def _run_group(group: list[Block], prelude: str = "") -> dict:
    """Runs a group's blocks in one fresh namespace, in a temporary directory; never raises.
    `prelude` runs first in that namespace (the planted fault of _PLANTED)."""
    start, environ, cwd = time.monotonic(), dict(os.environ), os.getcwd()
    names = ", ".join(b.name for b in group)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            os.chdir(tmp)  # a block that writes files writes them here
            namespace = {"__name__": "__main__"}
            exec(compile(prelude, "<prelude>", "exec"), namespace)  # noqa: S102
            for b in group:
                code = "\n" * b.line + b.source  # tracebacks name the page's own lines
                exec(compile(code, str(b.page.relative_to(ROOT)), "exec"), namespace)  # noqa: S102
        status, detail = "passed", ""
    except BaseException:  # noqa: BLE001 (SystemExit too: a block that exits has failed)
        status, detail = "failed", traceback.format_exc()
    finally:
        os.chdir(cwd)
        os.environ.clear()  # a block may set variables for a process it would start (XLA_FLAGS)
        os.environ.update(environ)
    return dict(names=names, status=status, detail=detail, seconds=time.monotonic() - start)


def _child_main(out: str) -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" not in flags:  # docs/many_devices.md: 8 devices
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    import jax

    jax.devices()  # the backend starts now, with the XLA_FLAGS it was given, whatever blocks set
    results = [_run_group(g) for g in groups()]
    # Last, as it patches the op for the rest of the process: quick start 1 made wrong.
    api = importlib.import_module("gated_attention.attention.api")
    right = api.dot_product_attention
    try:
        planted = _run_group([_quick_start_1()], prelude=_PLANTED)
    finally:
        api.dot_product_attention = right
    Path(out).write_text(json.dumps(dict(blocks=results, planted=planted)))


def _child(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    path = [str(ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**env, "PYTHONPATH": os.pathsep.join(path)}
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900
    )


def _blocks_process(out: Path) -> subprocess.CompletedProcess:
    """The blocks' process, with XLA's backend optimizations off (module docstring) and Python's
    fault handler on: a crash in compiled code prints the Python stack it happened under."""
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    args = ["-X", "faulthandler", "-m", "tests.test_docs", str(out)]
    done = _child(args, {**env, "XLA_FLAGS": f"{flags} {FAST_COMPILES}"}, ROOT)
    if done.returncode and "Unknown flag" in done.stderr:  # a jaxlib without it: compile as usual
        done = _child(args, env, ROOT)
    return done


def test_python_blocks_run(tmp_path):
    """Every block that is neither skipped nor deviceless, in one fresh process (module
    docstring); then, in that process, the AF2 quick start with the op made wrong (the pair bias
    dropped, which the MSA row and triangles take): its own check must fail (AF2's default
    zero_init would hide any op: every attention update is 0)."""
    out = tmp_path / "results.json"
    done = _blocks_process(out)
    if done.returncode < 0:  # killed by a signal (a segfault twice in ~10 full runs, 3.11 stack,
        # never in 42 runs alone): the crash and its stack are reported, the process runs again.
        died = f"the blocks' process died (exit {done.returncode}):\n{done.stderr[-4000:]}"
        warnings.warn(died, stacklevel=1)
        done = _blocks_process(out)
    assert done.returncode == 0, (  # a signal's exit is negative: say which
        f"the blocks' process failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n"
        f"{done.stderr[-6000:]}"
    )
    results = json.loads(out.read_text())
    blocks_run, planted = results["blocks"], results["planted"]
    assert len(blocks_run) == len(groups())
    failed = [f"{r['names']}:\n{r['detail']}" for r in blocks_run if r["status"] != "passed"]
    timings = ", ".join(f"{r['names']} {r['seconds']:.1f} s" for r in [*blocks_run, planted])
    print(f"times: {timings}")  # shown with -s, or -rA
    assert not failed, "\n".join(failed) + f"\n(times: {timings})"
    assert planted["status"] == "failed", "quick start 1 passed with the pair bias dropped"
    assert "AssertionError: msa" in planted["detail"], planted["detail"][-3000:]


# Quick start 1 with the op made wrong: the pair bias dropped, which the MSA row and triangles take.
_PLANTED = """import gated_attention.attention.api as op
right = op.dot_product_attention
op.dot_product_attention = lambda q, k, v, bias=None, mask=None, **kw: right(q, k, v, None, mask, **kw)
"""


def _quick_start_1() -> Block:
    return next(b for b in blocks(ROOT / "README.md") if "use_gated_attention()" in b.source)


@pytest.mark.parametrize("block", [b for b in _python() if b.deviceless], ids=lambda b: b.name)
def test_deviceless_block_runs(block, tmp_path):
    from gated_attention_tools import targets

    missing = targets.missing("h100")  # what the pages compile for
    if missing:
        pytest.skip(f"{block.name}: {missing}")
    script = tmp_path / "block.py"
    script.write_text(block.source)
    done = _child([str(script)], {**os.environ, **targets.CHILD_ENV}, tmp_path)
    assert done.returncode == 0, f"{block.name} failed:\n{done.stdout}\n{done.stderr[-6000:]}"


# What an alphafold3 block's process runs first: AF3's modules, imported as the tests import them.
_AF3_PRELUDE = "from gated_attention_tools import af3_model\naf3_model.load()\n"


@pytest.mark.parametrize("block", [b for b in _python() if b.alphafold3], ids=lambda b: b.name)
def test_alphafold3_block_runs(block, tmp_path):
    from gated_attention_tools import af3_model

    if not af3_model.installed():
        pytest.skip(f"{block.name}: {NEEDS_AF3}")
    script = tmp_path / "block.py"
    script.write_text(_AF3_PRELUDE + "\n" * (block.line - 2) + block.source)  # the page's lines
    scratch = tmp_path / "tmp"  # the process's temporary folder: the block leaves nothing there
    scratch.mkdir()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TMPDIR": str(scratch)}
    done = _child([str(script)], env, tmp_path)
    assert done.returncode == 0, f"{block.name} failed:\n{done.stdout}\n{done.stderr[-6000:]}"
    assert not list(scratch.iterdir()), f"{block.name} left {list(scratch.iterdir())}"
    assert "gated_attention_tools" not in block.source  # the test's set-up is not the page's


def test_the_alphafold3_marker_is_read(tmp_path):
    """A block after the alphafold3 marker is an alphafold3 block, kept out of the shared
    process's groups; the next block is not."""
    page = tmp_path / "page.md"
    page.write_text(f"{ALPHAFOLD3}\n```python\nimport alphafold3\n```\n\n```python\nx = 1\n```\n")
    first, second = blocks(page)
    assert first.alphafold3 and not first.skip and not second.alphafold3
    assert first.source == "import alphafold3\n"


@pytest.mark.parametrize("block", [b for b in _python() if b.skip], ids=lambda b: b.name)
def test_skipped_block(block):
    """Each block a page marks `<!-- skip: reason -->`, reported as skipped with that reason."""
    pytest.skip(f"{block.name}: {block.skip}")


def test_fences_are_known():
    found = [b for page in PAGES for b in blocks(page)]
    unknown = [f"{b.name}: ```{b.language}" for b in found if b.language not in LANGUAGES]
    assert not unknown, f"fences other than {sorted(LANGUAGES)}: {unknown}"


def test_block_markers_sit_on_a_block():
    """A skip or deviceless marker whose next non-blank line is not a ```python fence does
    nothing; neither does a shared-namespace marker on a page without python blocks."""
    for page in PAGES:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if SKIP.fullmatch(line.strip()) or line.strip() in (DEVICELESS, ALPHAFOLD3):
                following = next((x for x in lines[i + 1 :] if x.strip()), "")
                assert following.startswith("```python"), f"{page.name}:{i + 1}: {line}"
        if SHARED in lines:
            assert any(b.language == "python" for b in blocks(page)), page.name


_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def test_relative_links_resolve():
    """Every relative link or picture in README.md and docs/ names an existing file (as GitHub
    resolves it: relative to the page), and every #anchor into a page names one of its headings."""
    broken = []
    for page in PAGES:
        for target in _LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


def _anchors(page: Path) -> set[str]:
    """The ids MkDocs and GitHub give the page's headings (lower case, punctuation dropped)."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)
    slug = lambda h: re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
    return {slug(h.replace("`", "")) for h in headings}


_DEVICE = re.compile(r"\b(H100|H200|A100|B200|GPUs?|TPUs?|v5e|v5p|v6e)\b")
_MS = re.compile(r"(\d[\d,]*(?:\.\d+)?) ms\b")
_SUMMARY = re.compile(r"^<!-- device-summary: (\S+) -->$")


def _device_results() -> dict[str, dict]:
    """Each device run folder's results, its family suite's cells under "family"."""
    from gated_attention_tools import device_summary

    runs = sorted((ROOT / "benchmark_results" / "device").glob("*/results.json"))
    return {path.parent.name: device_summary.load(path.parent) for path in runs}


def test_device_figures_come_from_a_device_run():
    """A time in ms that a page quotes in a paragraph naming a GPU or TPU is a median or round
    of a device run in benchmark_results/device/, or a cell's hardware floor there (at the digits
    quoted), and each
    `<!-- device-summary: RUN -->` table is the one gated_attention_tools.device_summary writes
    from that run: a figure no device measured, or one a newer run replaced, fails here."""
    from gated_attention_tools import device_benchmark, device_summary

    runs = _device_results()
    times = [
        t
        for run in runs.values()
        for cell in run["cells"] + run["family"]
        for t in [cell.get("time_ms"), *cell.get("rounds_ms", [])]
        if t is not None
    ]
    floors = [  # a cell's hardware floor, as its results.md gives it, may be quoted too
        low["floor_ms"]
        for run in runs.values()
        for cell in run["cells"]
        if (low := device_benchmark.cell_floor(cell, run["environment"]["device_kind"]))
    ]
    unknown, stale = [], []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code is not a figure
        for paragraph in re.split(r"\n\s*\n", text):
            if not _DEVICE.search(paragraph):
                continue
            for quoted in _MS.findall(paragraph):
                value, digits = float(quoted.replace(",", "")), len(quoted.partition(".")[2])
                if not any(abs(t - value) <= 0.5 * 10**-digits + 1e-9 for t in times + floors):
                    unknown.append(f"{page.name}: {quoted} ms")
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            marker = _SUMMARY.match(line)
            if marker:
                expected = device_summary.table(runs[marker.group(1)]).splitlines()
                if lines[i + 1 : i + 1 + len(expected)] != expected:
                    stale.append(f"{page.name}:{i + 1}")
    assert not unknown, f"device times in no device run: {unknown}"
    assert not stale, f"device summaries that differ from device_summary.table: {stale}"
    assert times, "no device run with timed cells in benchmark_results/device/"


def test_api_reference_lists_every_public_name():
    import gated_attention as ga

    api = (ROOT / "docs" / "api.md").read_text()
    documented = set(re.findall(r"^::: gated_attention\.(\w+)\s*$", api, flags=re.M))
    assert set(ga.__all__) <= documented, sorted(set(ga.__all__) - documented)


FRONT_DOOR_LINES = 60  # the first screen: what it is, set-up, what it does, GPU answer, limits


def test_readme_is_the_front_door():
    """At most README_MAX_LINES lines. Its first FRONT_DOOR_LINES lines say what it is, hold the
    two set-up commands (the second is what .ci/run runs, verbatim), the table of what it does
    with where each row was measured, the GPU answer for training and inference, and what it does
    not do. Three quick starts follow, each saying first what it needs installed, each block
    printing what it checked."""
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= README_MAX_LINES, len(lines)
    first = "\n".join(lines[:FRONT_DOOR_LINES])
    commands = [b.source.strip() for b in blocks(ROOT / "README.md") if b.language == "bash"][:2]
    assert len(commands) == 2 and all(c in first for c in commands), commands
    assert "scripts/run_forward.py" in commands[0]
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"\n{commands[1]} || exit 1\n" in ci, "the README's test command is not .ci/run's"
    table = [x for x in first.splitlines() if x.startswith("| ") and not x.startswith("| ---")]
    where = ("on 2 CPU cores", "on one H100 GPU", "on one H200 GPU", "compiled for an")
    assert len(table) >= 4 and all(any(w in row for w in where) for row in table[1:]), table
    for needed in ("**Training: ", "**Inference: ", "**Not measured on a GPU yet:**"):
        assert needed in first, needed
    limits = first.index("## What it does not do")
    assert first[limits:].count("\n* ") >= 2, "the limits' bullets end past the first screen"
    quick = [i for i, line in enumerate(lines) if line.startswith("## Quick start")]
    assert len(quick) == 3, quick
    for i in quick:
        assert lines[i + 2].startswith("Needs "), lines[i + 2]
    runnable = [b for b in blocks(ROOT / "README.md") if b.language == "python"]
    assert len(runnable) == 3 and all("print(f" in b.source for b in runnable)


_RATIO = re.compile(r"(?<![\w.])\d+\.\d\d(?:-\d+\.\d\d)?x\b")


def test_readme_gpu_ratios_come_from_the_device_summary():
    """Every ratio the README quotes on a line naming a GPU, or under a heading naming one, is a
    cell of a device run's summary table (device_summary.table): prose and table agree."""
    from gated_attention_tools import device_summary

    cells = {
        cell.strip()
        for run in _device_results().values()
        for row in device_summary.table(run).splitlines()
        for cell in row.split("|")
    }
    text = re.sub(r"```.*?```", "", (ROOT / "README.md").read_text(), flags=re.S)
    quoted, section = [], ""
    for line in text.splitlines():
        if line.startswith("#"):
            section = line
        if _DEVICE.search(line) or _DEVICE.search(section):
            quoted += _RATIO.findall(line)
    assert quoted, "no GPU ratio quoted"
    assert not [q for q in quoted if q not in cells], sorted(set(quoted) - cells)


FIGURES = "<!-- docs-test: figures-from-block -->"
_NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?!\w)")


def test_figures_in_prose_come_from_their_block():
    """A paragraph marked `<!-- docs-test: figures-from-block -->` quotes only numbers that
    appear in the python block before it (which prints or asserts them), so that a reader's run
    agrees with the page: the block's bounds, not one run's values."""
    marked = 0
    for page in PAGES:
        lines = page.read_text().splitlines()
        python = [b for b in blocks(page) if b.language == "python"]
        for i, line in enumerate(lines):
            if line.strip() != FIGURES:
                continue
            marked += 1
            paragraph = " ".join(itertools.takewhile(str.strip, lines[i + 1 :]))
            before = [b for b in python if b.line < i + 1]
            assert before and paragraph, f"{page.name}:{i + 1}: no block before, or no paragraph"
            quoted = set(_NUMBER.findall(paragraph))
            missing = quoted - set(_NUMBER.findall(before[-1].source))
            assert quoted and not missing, (
                f"{page.name}:{i + 1}: {sorted(missing)} not in the block"
            )
    assert marked, "no paragraph marked"


if __name__ == "__main__":  # the blocks' process (test_python_blocks_run)
    _child_main(sys.argv[1])
