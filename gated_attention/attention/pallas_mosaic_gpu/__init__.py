"""The fused Hopper (sm_90a) kernel in Pallas's Mosaic GPU backend: TMA pipeline and wgmma."""
