"""Many devices and row loops: placement over a mesh (sharding), the row loop with its own
backward (row_loop) and attention over keys split across devices (ring)."""
