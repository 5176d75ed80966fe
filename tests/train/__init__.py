"""Tests of training, checkpoints and the generated data sets."""
