"""The package version, in a module of its own so modules can read it without importing the package's exports."""

__version__ = "0.1.0"
