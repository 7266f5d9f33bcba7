"""``python -m fastdist.run``: the same as ``fastdist run`` (see fastdist.launcher)."""

from __future__ import annotations

import sys

from .launcher import main

if __name__ == "__main__":
    sys.exit(main())
