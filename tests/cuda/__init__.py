"""Tests that need a CUDA GPU: FlexAttention and SDPA dispatch, parity, traces."""
