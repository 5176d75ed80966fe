"""Helpers shared by the tests of every layer: hypothesis strategies for attention cases
(:mod:`tests.support.strategies`) and small recorded traces (:mod:`tests.support.traces`)."""
