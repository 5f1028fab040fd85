"""Megatron-style tensor parallelism with sequence parallelism (``parallel.tp``)."""
