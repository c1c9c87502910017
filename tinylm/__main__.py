"""``python -m tinylm init|serve ...`` (the same as ``rollout tinylm ...``)."""

import sys

from tinylm.cli import main

sys.exit(main())
