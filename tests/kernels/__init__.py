"""Tests of the tiled kernel against the reference."""
