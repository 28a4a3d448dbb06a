"""The kernel matrix: the library's GPU and TPU kernels compiled for a target without its device
(XLA's real compilers, deviceless: gated_attention_tools/targets.py), a matrix of cases each, and
what the compiler says of them read back. Nothing runs on a GPU or TPU: these say what compiles
and how, never how fast.

One module per kernel family (the folders of gated_attention/attention/), each with its case list,
its reader of the compiler's output and its command (`python -m
gated_attention_tools.kernel_matrix.<module> --help`):

  pallas_triton       the Triton kernels (PallasAttention) for A100, H100, B200: ptxas's registers,
                      spills, shared memory, tensor-core MMA (benchmark_results/gpu_kernels/)
  pallas_mosaic_gpu   the Mosaic GPU kernels (MosaicAttention) for an H100: ptxas's registers and
                      spills, wgmma, shared memory (benchmark_results/mosaic_kernels/)
  pallas_mosaic_tpu   the Mosaic TPU kernels (PallasTpuAttention) for v5e, v5p, v6e: which compile
                      within the scoped VMEM, their device memory (benchmark_results/tpu_kernels/)
  tile_table          the Triton kernels' tile table, generated from pallas_triton's results

and `common`, what they share: the case schema, the matrix of cases, the loop compiling the cases
in child processes, the writing of results and their markdown.
"""
