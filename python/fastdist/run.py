"""``python -m fastdist.run``: the same as ``fastdist run`` (see fastdist.tools.launcher)."""

from __future__ import annotations

import sys

from .tools.launcher import main

if __name__ == "__main__":
    sys.exit(main())
