"""The installed distribution's version (pyproject.toml's), for `instar --version` and ``instar.__version__``."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("instar")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
