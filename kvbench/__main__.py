"""``python -m kvbench strategy=int8 task=legal``."""

from kvbench.cli import main

if __name__ == "__main__":
    main()
