"""Long-context tasks: real documents, needles at known depths, and continuation scoring."""

from kvbench.tasks.base import Sample, build_samples, register_task, task_names

__all__ = ["Sample", "build_samples", "register_task", "task_names"]
