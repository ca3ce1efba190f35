"""Importing this module registers every backend of this repository (llmq.backend's registry);
the bundle is registered by the core itself. Add a backend: one import line here."""

import llmq_cuda.backend  # noqa: F401  cuda
import llmq_gguf.backend  # noqa: F401  gguf
import llmq_hf.backend  # noqa: F401  hf-modelopt, hf-compressed-tensors
import llmq_mlx.backend  # noqa: F401  mlx
