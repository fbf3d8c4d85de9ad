"""``python -m kvbench strategy=int8 task=legal``."""

from kvbench.cli import interruptible, main

if __name__ == "__main__":
    interruptible(main)
