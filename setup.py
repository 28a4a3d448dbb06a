"""Installs the library, gated_attention, alone: `pip install -e .[test,targets]` for the tests,
`.[af2]` for AlphaFold 2 (alphafold-colabfold) beside it, `.[af3]` for AlphaFold 3's own model
(Python >= 3.12; in `test` too), `.[colabdesign]` for ColabDesign's design steps, `.[bench]` for the benchmark (AF2's package as the baseline,
plots), `.[targets]` for compiling for GPUs and TPUs on a machine without them, `.[gpu-bench]` (with JAX's CUDA build) for the GPU
benchmark's other kernels. The tooling behind scripts/, configs/ and tests/ (gated_attention_tools:
the experiment schema, the benchmarks, the deviceless compiles) is not in the wheel: it runs from a
checkout, as scripts/ and configs/ do (`python -m gated_attention_tools.<tool>` from its root)."""

import re
from pathlib import Path

from setuptools import find_packages, setup

VERSION = re.search(
    r'__version__ = "([^"]+)"',
    Path(__file__).with_name("gated_attention").joinpath("__init__.py").read_text(),
).group(1)

# AlphaFold 3 as ColabFold packages it (Python >= 3.12 only): the package and what it imports but
# does not declare (tokamax, RDKit). tests/af3 runs its modules with our attention; skipped on 3.11.
AF3 = [
    f"{requirement}; python_version >= '3.12'"
    for requirement in ("alphafold3-colabfold==3.1.18", "tokamax==0.0.17", "rdkit==2026.9.1")
]

# ColabDesign (protein design through AF2; BindCraft runs it): the registry's release, which
# gated_attention.colabdesign.adapt_colabdesign runs on jax >= 0.10. tests/af2/test_colabdesign.py
# runs its design steps with our attention.
COLABDESIGN = ["colabdesign==1.1.1"]

setup(
    name="gated_attention",
    version=VERSION,
    description="AlphaFold-style gated multi-head attention for JAX and Haiku: fast, memory-efficient, "
    "AlphaFold 2 parameter compatible.",
    long_description=Path(__file__).with_name("README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["gated_attention", "gated_attention.*"]),
    python_requires=">=3.11",
    classifiers=[
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
    ],
    install_requires=[
        # Tested range (.ci/run): jax 0.10.2 on Python 3.11 (what AlphaFold 3 pins) to 0.12.0.1 on
        # Python 3.12 (the newest served). 0.10 is the floor: sharding.py reads explicit shardings
        # (jax.typeof, jax.shard_map); gated_attention/core/compat.py says so at import on an older one.
        "jax>=0.10",
        "jaxlib>=0.10",
        "dm-haiku>=0.0.13",
        "numpy>=1.24",
        "absl-py>=1.0",
        "ml_collections>=0.1.1",
    ],
    package_data={
        "gated_attention.attention": ["tuning.json"],  # tuning.py
        "gated_attention.attention.pallas_triton": ["tile_table.json"],  # tile_table.py
    },
    extras_require={
        # ruff pinned: its format output changes between releases. AF2 as users install it
        # (alphafold-colabfold, whose modules.py imports colabfold-kernels): the tests run its
        # EvoformerIteration with our attention, and the benchmarks take it as the baseline.
        "test": [
            "pytest>=7",
            "setuptools>=61",  # tests/test_layout.py reads setup.py's packages
            "pytest-xdist>=3",
            "hypothesis>=6",
            "ruff==0.17.6",
            "matplotlib>=3.7",  # the benchmark's pictures are tested
            "alphafold-colabfold==2.3.27",
            "colabfold-kernels==0.9.0",
            *COLABDESIGN,
            # The device benchmark's cuEquivariance adapter, tested on its JAX path (pure Python).
            "cuequivariance-jax==0.13.0",
            *AF3,
        ],
        "af3": AF3,
        "colabdesign": COLABDESIGN,
        # Deviceless compiles for GPUs and TPUs (gated_attention_tools/targets.py): JAX's CUDA
        # plugin and PJRT at the installed jax's version (jax's cuda12-local extra pins them, with
        # no CUDA libraries), ptxas, and the libtpu that jax's tpu extra pins. Linux x86-64 wheels.
        "targets": [
            "jax[cuda12-local,tpu]; sys_platform == 'linux' and platform_machine == 'x86_64'",
            "nvidia-cuda-nvcc-cu12; sys_platform == 'linux' and platform_machine == 'x86_64'",
            # CUDA 13's ptxas and nvdisasm: the SASS proxy (sass_proxy.py; Mosaic GPU writes PTX 9.0).
            "nvidia-cuda-nvcc==13.5.37; sys_platform == 'linux' and platform_machine == 'x86_64'",
            "nvidia-cuda-nvdisasm==13.5.37; sys_platform == 'linux' and platform_machine == 'x86_64'",
        ],
        # AlphaFold 2 as ColabFold installs it, alone: the README's first quick start and
        # docs/alphafold.md (AF2's modules.py imports colabfold-kernels).
        "af2": ["alphafold-colabfold==2.3.27", "colabfold-kernels==0.9.0"],
        "bench": ["matplotlib>=3.7", "alphafold-colabfold==2.3.27", "colabfold-kernels==0.9.0"],
        # The documentation site and API reference (mkdocs.yml, docs/), built by .ci/run with
        # `mkdocs build --strict`; pinned: what the build warns about changes between releases.
        "docs": ["mkdocs==1.6.1", "mkdocstrings==1.0.8", "mkdocstrings-python==2.0.11"],
        # The GPU benchmark's other kernels: AF2 as alphafold-colabfold runs it on GPU (with
        # colabfold-kernels), tokamax (0.0.12 is the release AF3 pins with jax 0.10.2; Python
        # 3.12 with jax >= 0.11.1 takes 0.0.17) and NVIDIA cuEquivariance's CUDA 12 kernels.
        "gpu-bench": [
            "matplotlib>=3.7",
            "alphafold-colabfold==2.3.27",
            "colabfold-kernels==0.9.0",
            "tokamax>=0.0.12",
            "cuequivariance-jax==0.13.0",
            "cuequivariance-ops-jax-cu12==0.13.0",
        ],
    },
)
