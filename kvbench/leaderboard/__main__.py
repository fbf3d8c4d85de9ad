"""``python -m kvbench.leaderboard``: the same command as ``kvbench leaderboard``."""

import sys

from kvbench.leaderboard import main

sys.exit(main())
