"""The package version: one place, read by pyproject.toml, swa_tvm.__version__, the
manifests and the JIT cache key."""

__version__ = "0.1.0"
