"""kvbench: a benchmark harness for KV-cache methods in long-context LLM inference."""

__version__ = "0.1.0"
