"""Tests of the worked-example format."""
