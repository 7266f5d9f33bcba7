"""The compiled extensions, imported here only: ``_core`` (the deadline engine, no torch in it)
and ``_watched`` (the watched c10d backend, which links libtorch)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

import torch

from ._build_info import TORCH_VERSION

if torch.__version__ != TORCH_VERSION:
    # fastdist._watched links libtorch: a build serves exactly the torch it was compiled against.
    raise ImportError(
        f"fastdist was built against torch {TORCH_VERSION}, and this is torch "
        f"{torch.__version__}: rebuild fastdist for this torch (pip install --no-build-isolation "
        "--force-reinstall --no-deps <fastdist source>, or make setup)"
    )

if TYPE_CHECKING:  # typed by the stubs beside this file (_core.pyi, _watched.pyi)
    from . import _core, _watched
else:  # extension modules: loaded by their full names
    _core = importlib.import_module("fastdist._core")
    _watched = importlib.import_module("fastdist._watched")

__all__ = ["_core", "_watched"]
