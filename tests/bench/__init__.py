"""Tests of qkv bench."""
