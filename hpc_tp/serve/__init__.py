"""Inference: KV cache, incremental decoding, sampling, batch and HTTP serving, encoder embeddings."""
