"""``python -m fastdist``: the ``fastdist`` command (fastdist.tools.cli)."""

import sys

from .tools.cli import main

sys.exit(main())
