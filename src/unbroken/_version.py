"""The package version, in one place (read by ``pyproject.toml`` and the manifest)."""

__version__ = "0.1.0"
