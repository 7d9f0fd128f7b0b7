"""Runnable examples: a small language model trained with ZeRO-1 and an NVFP4 parameter all-gather."""
