"""``python -m engine.tinylm init|serve ...`` (the same as ``rollout tinylm ...``)."""

import sys

from engine.tinylm.cli import main

sys.exit(main())
