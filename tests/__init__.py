"""The test suite of gated_attention (a package, so that every file imports `tests.<module>`)."""
