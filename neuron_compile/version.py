"""The package version, in a module of its own so that any stage can name it without importing the package."""

__version__ = "0.1.0"
