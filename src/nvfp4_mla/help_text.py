"""Help texts from docstrings, for the command line and the benchmark's parsers."""

from __future__ import annotations


def plain(text: str) -> str:
    """A docstring paragraph as help text: without reST's double backticks."""
    return text.replace("``", "")
