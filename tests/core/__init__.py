"""Tests of the NumPy core: attention, masks, trace, errors, the step vocabulary."""
