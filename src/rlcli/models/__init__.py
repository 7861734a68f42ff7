"""Models: the cache, loading with LoRA and quantisation, checkpoints, tiny test models."""
