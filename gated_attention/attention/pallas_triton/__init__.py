"""The fused GPU kernel in Pallas's Triton lowering (deprecated by JAX) and its tile table."""
