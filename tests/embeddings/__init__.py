"""Tests of word vectors."""
