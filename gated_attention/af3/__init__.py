"""AlphaFold 3's own model (the `alphafold3-colabfold` package, Python >= 3.12) running this
library's attention: `use_gated_attention()` (swap.py). Importing this imports no AlphaFold 3:
the swap imports it when entered."""

from gated_attention.af3.swap import (
    AF3_NAMES,
    ENTRY_POINTS,
    af3_implementation,
    use_gated_attention,
)

__all__ = ["AF3_NAMES", "ENTRY_POINTS", "af3_implementation", "use_gated_attention"]
