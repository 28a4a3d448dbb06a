r"""Downloads the wheels a GPU or TPU machine without network needs for scripts/device_check.py.

The device machines this project borrows have Python 3.12 with jax, pytest, pytest-xdist, chex,
hypothesis, NumPy, SciPy, pandas, absl-py, PyYAML, tabulate, attrs and wrapt, and reach no package
registry. What this project and its AF2 baseline need besides (about 18 MB) is downloaded here as
Python 3.12 manylinux x86-64 wheels, pinned to the versions the tests ran with:

  python scripts/device_wheels.py                   # -> .device_wheels/ (git-ignored)
  python scripts/device_wheels.py --dest=DIR --dry_run

and installed there without an index (docs/gpu_tpu.md, "The device run"):

  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device_wheels/*.whl
"""

import pathlib
import subprocess
import sys

from absl import app, flags

# Each with its version: one version of each (two stop the whole install there), as tested.
WHEELS = (
    "dm-haiku==0.0.17",
    "jmp==0.0.4",
    "ml-collections==1.1.0",
    "dm-tree==0.1.10",
    # AF2 as users install it (the benchmark's baseline), with what it imports beyond the image.
    "alphafold-colabfold==2.3.27",
    "biopython==1.88",
    "immutabledict==4.3.1",
    "colabfold-kernels==0.9.0",
    "colabfold-legacy-kernels==0.6.0",
    "colabfold-cuda-kernels==0.2.2",
)
PYTHON = "3.12"
# pip matches a manylinux tag exactly: every glibc level these wheels are built for.
PLATFORMS = tuple(f"manylinux_2_{n}_x86_64" for n in (28, 27, 24, 17)) + (
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)

_DEST = flags.DEFINE_string("dest", ".device_wheels", "Folder the wheels are written to.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the pip command instead of running it.")


def command(dest: str, python: str = PYTHON) -> list[str]:
    """The pip download command for WHEELS, binary only, for `python` on Linux x86-64."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--python-version", python, "--implementation", "cp", *platforms, "-d", dest, *WHEELS,
    ]  # fmt: skip


def check(dest: pathlib.Path) -> list[str]:
    """What is wrong with the downloaded folder: a wheel of WHEELS missing or there twice."""
    problems = []
    files = sorted(p.name.lower() for p in dest.glob("*.whl"))
    for wheel in WHEELS:
        name, version = wheel.split("==")
        prefix = name.replace("-", "_").lower() + "-"
        found = [f for f in files if f.startswith(prefix)]
        if [f for f in found if f.startswith(f"{prefix}{version}-")] != found or len(found) != 1:
            problems.append(f"{wheel}: found {found or 'nothing'}")
    return problems


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    cmd = command(_DEST.value)
    if _DRY_RUN.value:
        print(" ".join(cmd))
        return
    subprocess.run(cmd, check=True)
    dest = pathlib.Path(_DEST.value)
    problems = check(dest)
    if problems:
        sys.exit("wheels missing or doubled in " + f"{dest}: " + "; ".join(problems))
    size = sum(p.stat().st_size for p in dest.glob("*.whl")) / 2**20
    print(f"{len(WHEELS)} wheels, {size:.1f} MiB, in {dest}")


if __name__ == "__main__":
    app.run(main)
