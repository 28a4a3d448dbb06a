"""AlphaFold 3's network modules for the tests (gated_attention_tools/af3_model.py: imported with
empty chemical-component tables where the package has none, which it says how), or a skip where
alphafold3-colabfold is absent (the Python 3.11 stack: it needs Python >= 3.12)."""

from __future__ import annotations

import types

import pytest

from gated_attention_tools import af3_model

REASON = "needs alphafold3-colabfold (Python >= 3.12: pip install -e '.[test]' on that stack)"


def load() -> types.SimpleNamespace:
    """af3_model.load(), or a pytest skip where AF3 is absent."""
    if not af3_model.installed():
        pytest.skip(REASON)
    return af3_model.load()
