"""The package version, written once: pyproject.toml reads it (setuptools dynamic version), the
package and checkpoint manifests import it."""

__version__ = "0.1.0"
