"""The compiled extensions, imported here only: ``_core`` (the deadline engine, no torch in it)
and ``_watched`` (the watched c10d backend, which links libtorch); and which of a group's
backends are watched ones."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import torch

from ._build_info import TORCH_VERSION

if torch.__version__ != TORCH_VERSION:
    # fastdist._watched links libtorch: a build serves exactly the torch it was compiled against.
    raise ImportError(
        f"fastdist was built against torch {TORCH_VERSION}, and this is torch "
        f"{torch.__version__}: rebuild fastdist for this torch (pip install --no-build-isolation "
        "--force-reinstall --no-deps <fastdist source>, or make setup)"
    )

# The torch releases fastdist is built and tested against (the compatibility lane,
# scripts/compat-lane: 2.11 and 2.14; make test: 2.13). Each needs its own build.
SUPPORTED_TORCH = ((2, 11), (2, 14))


def torch_supported(version: str = torch.__version__) -> bool:
    """Whether ``version`` (a torch version string) is one fastdist supports."""
    try:
        major, minor = (int(p) for p in version.split("+")[0].split(".")[:2])
    except ValueError:
        return False
    return SUPPORTED_TORCH[0] <= (major, minor) <= SUPPORTED_TORCH[1]


if TYPE_CHECKING:  # typed by the stubs beside this file (_core.pyi, _watched.pyi)
    # The modules by their full names: "from . import" would read as an import of the package's
    # __init__, the top floor, from this bottom one.
    import fastdist._core as _core  # noqa: PLR0402
    import fastdist._watched as _watched  # noqa: PLR0402
else:  # extension modules: loaded by their full names
    _core = importlib.import_module("fastdist._core")
    _watched = importlib.import_module("fastdist._watched")

__all__ = ["SUPPORTED_TORCH", "_core", "_watched", "hand_engine_over", "torch_supported", "watched_backends"]


def watched_backends(pg: Any) -> list[Any]:
    """Every distinct WatchedBackend registered in the ProcessGroup ``pg``, in its devices'
    order: none for a group fastdist does not watch (or anything that is not a ProcessGroup)."""
    if not isinstance(pg, torch.distributed.ProcessGroup):
        return []
    try:
        types = list(pg._device_types) or [torch.device("cpu")]
    except (AttributeError, RuntimeError):
        return []
    out: list[Any] = []
    for device in types:
        try:
            backend = pg._get_backend(device)
        except RuntimeError:
            continue
        if isinstance(backend, _watched.WatchedBackend) and all(b.ctl_id != backend.ctl_id for b in out):
            out.append(backend)
    return out


_engine_handed = False


def hand_engine_over() -> None:
    """Gives ``_watched`` the one deadline engine of ``_core`` (before any GroupCtl is made)."""
    global _engine_handed
    if not _engine_handed:
        _watched.set_engine(_core._engine_capsule())
        _engine_handed = True
