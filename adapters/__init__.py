"""Tensors at the edge: numpy, torch and inference-library KV-cache adapters (arrive later)."""
