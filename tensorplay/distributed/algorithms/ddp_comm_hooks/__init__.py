"""DDP communication hooks, each also available traced: ``traced(bf16_compress_hook)``."""
