"""Tests of the renderers: text, Markdown, LaTeX, JSON, pictures, the HTML page."""
