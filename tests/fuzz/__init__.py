"""Tests of hostile and malformed files on every surface."""
