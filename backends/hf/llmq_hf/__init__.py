"""Hugging Face quantized-folder backends (--backend=hf-modelopt, --backend=hf-compressed-tensors):
the pipeline's stream through llmq.export.write_hf_quantized_checkpoint. `import llmq_hf.backend`
registers them."""
