"""The chunked implementation in plain XLA: query x key tiles with an online softmax."""
