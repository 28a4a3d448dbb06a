"""gated_attention_tools: the tooling behind scripts/, configs/ and tests/, not the library.

The experiment schema of configs/*.py (schema), config-driven forward passes (run), the benchmark
(benchmark) with AlphaFold 2's formulation as its baseline (af2_baseline), and the measurements they
share (measure). `import gated_attention` never loads it; import its modules by name.
"""
