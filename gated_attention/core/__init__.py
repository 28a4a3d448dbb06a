"""The shared pieces, no Haiku and no kernels: argument checks, the numerics contract, the
structured masks, platforms, memory estimates and every touch of JAX's internals (compat)."""
