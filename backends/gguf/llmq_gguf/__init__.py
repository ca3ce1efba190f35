"""GGUF backend (--backend=gguf): llmq's quantized stream as one .gguf file llama.cpp runs.
`import llmq_gguf.backend` registers it."""
