"""kvsim: capacity planner for long-context LLM serving with the KV cache partly in host memory."""

__version__ = "0.1.0"
