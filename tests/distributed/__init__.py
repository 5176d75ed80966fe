"""Tests of qkv.distributed: layouts and ring attention across processes (gloo on CPU)."""
