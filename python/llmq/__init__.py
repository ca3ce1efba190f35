"""llmq: quantize LLM checkpoints into backend-packed weights, and prove they still work."""

__version__ = "0.1.0"
