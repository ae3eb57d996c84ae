"""The package version: the one place it is written (setup.py reads it, torch_ext exports it)."""

__version__ = "0.1.0"
