"""fastdist's version, read once from the installed package's metadata (pyproject.toml is the
one place it is written)."""

from __future__ import annotations

import importlib.metadata

try:
    __version__ = importlib.metadata.version("fastdist")
except importlib.metadata.PackageNotFoundError:  # imported from a source tree
    __version__ = "0+unknown"
