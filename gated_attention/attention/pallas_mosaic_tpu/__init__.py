"""The fused TPU kernel in Pallas's Mosaic TPU backend."""
