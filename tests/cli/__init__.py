"""Tests of the command line and the commands the docs print."""
