"""``python -m workers ...``: the ``rollout`` command."""

import sys

from workers.cli import main

sys.exit(main())
