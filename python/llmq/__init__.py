"""llmq: quantize LLM checkpoints into backend-packed weights, and prove they still work."""

__version__ = "0.1.0"

from llmq import harmless_logs as _harmless_logs

_harmless_logs.install()
