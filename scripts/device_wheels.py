r"""Downloads the wheels a GPU or TPU machine without network needs for scripts/device_check.py.

The device machines this project borrows have Python 3.12 with jax, pytest, pytest-xdist, chex,
hypothesis, NumPy, SciPy, pandas, flax, optax, jaxtyping, absl-py, PyYAML, tabulate, attrs and
wrapt, and reach no package registry. What this project, its AF2 baseline and the peers need
besides is downloaded here as Python 3.12 manylinux x86-64 wheels, pinned, in sets; a call to the
device carries at most 64 MiB, so each call's folder holds the sets it needs (sizes as downloaded):

  core            haiku, jmp, ml-collections, dm-tree: the library and the scripts       0.7 MiB
  af2             AF2 as users install it, ColabFold's kernels (the baselines)          17 MiB
  tokamax         tokamax 0.0.17 and what it imports beyond the image (xprof: 30 MiB)   36 MiB
  cuequivariance  NVIDIA cuEquivariance with its CUDA 13 kernels (a call of its own)    52 MiB

  python scripts/device_wheels.py                                    # core,af2,tokamax -> .device_wheels/
  python scripts/device_wheels.py --sets=core,cuequivariance --dest=.device_wheels_cue
  python scripts/device_wheels.py --dest=DIR --dry_run

and installed there without an index (docs/gpu_tpu.md, "The device run"):

  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device_wheels/*.whl
"""

import pathlib
import subprocess
import sys

from absl import app, flags

# Each with its version: one version of each (two stop the whole install there), as tested.
WHEEL_SETS = {
    "core": ("dm-haiku==0.0.17", "jmp==0.0.4", "ml-collections==1.1.0", "dm-tree==0.1.10"),
    # AF2 as users install it (the benchmark's baseline), with what it imports beyond the image.
    "af2": (
        "alphafold-colabfold==2.3.27",
        "biopython==1.88",
        "immutabledict==4.3.1",
        "colabfold-kernels==0.9.0",
        "colabfold-legacy-kernels==0.6.0",
        "colabfold-cuda-kernels==0.2.2",
    ),
    # tokamax imports xprof (its benchmarking module; with fire, termcolor and six) but not
    # tensorboardx, which it lists too; immutabledict comes with af2. Checked on CPU: Python 3.12,
    # jax 0.11.2 and the image's packages, tokamax's xla_chunked against jax.nn.
    "tokamax": (
        "tokamax==0.0.17",
        "einshape==1.0",
        "pydantic==2.14.4",
        "pydantic-core==2.50.5",
        "annotated-types==0.8.0",
        "typing-inspection==0.4.5",
        "qwix==0.1.8",
        "tqdm==4.70.1",
        "xprof==2.24.2",
        "fire==0.7.1",
        "termcolor==3.3.0",
        "six==1.17.0",
    ),
    "cuequivariance": (
        "cuequivariance==0.13.0",
        "cuequivariance-jax==0.13.0",
        "cuequivariance-ops-jax-cu13==0.13.0",  # the image's jax runs CUDA 13
        "cuequivariance-ops-cu13==0.13.0",
        "einops==0.8.2",
        "sympy==1.14.0",
        "mpmath==1.3.0",
        "networkx==3.7",
        "nvidia-ml-py==13.615.71",
        "platformdirs==4.14.8",
        "tqdm==4.70.1",
    ),
}
DEFAULT_SETS = ("core", "af2", "tokamax")
WHEELS = tuple(w for name in DEFAULT_SETS for w in WHEEL_SETS[name])
MAX_MIB = 60  # a call carries 64 MiB with the working tree (about 5 MiB)
PYTHON = "3.12"
# pip matches a manylinux tag exactly: every glibc level these wheels are built for.
PLATFORMS = tuple(f"manylinux_2_{n}_x86_64" for n in (28, 27, 24, 17)) + (
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)

_DEST = flags.DEFINE_string("dest", ".device_wheels", "Folder the wheels are written to.")
_SETS = flags.DEFINE_list("sets", list(DEFAULT_SETS), f"Wheel sets, of {sorted(WHEEL_SETS)}.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the pip command instead of running it.")


def wheels(sets=DEFAULT_SETS) -> tuple[str, ...]:
    """The pinned wheels of the named sets, each once, in order."""
    unknown = [name for name in sets if name not in WHEEL_SETS]
    if unknown:
        raise ValueError(f"--sets must name sets of {sorted(WHEEL_SETS)}, got {unknown}")
    return tuple(dict.fromkeys(w for name in sets for w in WHEEL_SETS[name]))


def command(dest: str, python: str = PYTHON, sets=DEFAULT_SETS) -> list[str]:
    """The pip download command for the sets' wheels, binary only, for `python` on Linux x86-64."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--python-version", python, "--implementation", "cp", *platforms, "-d", dest,
        *wheels(sets),
    ]  # fmt: skip


def check(dest: pathlib.Path, sets=DEFAULT_SETS) -> list[str]:
    """What is wrong with the downloaded folder: a wheel of the sets missing or there twice, or
    more than a device call carries."""
    problems = []
    files = sorted(p.name.lower() for p in dest.glob("*.whl"))
    size = sum(p.stat().st_size for p in dest.glob("*.whl")) / 2**20
    if size > MAX_MIB:
        problems.append(f"{size:.1f} MiB of wheels, over the {MAX_MIB} MiB a device call carries")
    for wheel in wheels(sets):
        name, version = wheel.split("==")
        prefix = name.replace("-", "_").lower() + "-"
        found = [f for f in files if f.startswith(prefix)]
        if [f for f in found if f.startswith(f"{prefix}{version}-")] != found or len(found) != 1:
            problems.append(f"{wheel}: found {found or 'nothing'}")
    return problems


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    sets = tuple(_SETS.value)
    cmd = command(_DEST.value, sets=sets)
    if _DRY_RUN.value:
        print(" ".join(cmd))
        return
    subprocess.run(cmd, check=True)
    dest = pathlib.Path(_DEST.value)
    problems = check(dest, sets)
    if problems:
        sys.exit(f"wheels in {dest}: " + "; ".join(problems))
    size = sum(p.stat().st_size for p in dest.glob("*.whl")) / 2**20
    print(f"{len(wheels(sets))} wheels ({', '.join(sets)}), {size:.1f} MiB, in {dest}")


if __name__ == "__main__":
    app.run(main)
