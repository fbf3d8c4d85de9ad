"""kvbench: a benchmarking harness for KV-cache optimisation in LLM inference."""

__version__ = "0.1.0"
SPEC_VERSION = "1.2"
