"""Tests of qkv check."""
