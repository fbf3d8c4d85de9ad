"""``python -m kvbench.lmeval {run,export,import} ...``."""

from kvbench.lmeval.cli import main

raise SystemExit(main())
