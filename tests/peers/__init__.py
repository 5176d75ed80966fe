"""Tests of expectations ported from peers: PyTorch's SDPA tests, transformers' models."""
