"""Tests of the PyTorch modules, the KV cache and model tracing."""
