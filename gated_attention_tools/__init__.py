"""gated_attention_tools: the tooling behind scripts/, configs/ and tests/, not the library.

The experiment schema of configs/*.py (schema), config-driven forward passes (run), and the benchmark
(benchmark) with AlphaFold 2's formulation as its baseline (af2_baseline). `import gated_attention`
never loads it; import its modules by name.
"""
