"""gated_attention_tools: the tooling behind scripts/, configs/ and tests/, not the library, and not
in its wheel (setup.py): it runs from a checkout (`python -m gated_attention_tools.<tool>` there).

The experiment of configs/*.py (experiment/: its schema and config-driven forward passes), the benchmark
(benchmark, each cell in a fresh process: benchmark_cell) with AlphaFold 2's own modules (the
alphafold-colabfold package) as its baseline, the GPU and TPU benchmark (device_benchmark), and the
measurements they share (measure). `import gated_attention` never loads it; import its modules by
name.
"""
