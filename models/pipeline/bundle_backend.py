"""--backend=bundle: the portable llmq bundle (llmq.checkpoint.save_bundle), which stores every
format the library can quantize; what it accepts is the format registry's list."""

from llmq.quant.formats import format_names

ACCEPTS_FORMATS = format_names(quantizable=True)
