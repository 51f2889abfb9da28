"""The package's version, in one place: nanovllm.__version__, the server's /version and the
package metadata (pyproject.toml reads it from here) all give this."""
__version__ = "0.1.0"
