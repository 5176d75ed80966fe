"""Tests of the HTML page in real Chromium."""
