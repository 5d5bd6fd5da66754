"""The package version (one place; the store marker and ``runs`` rows record it)."""
__version__ = "0.1.0"
