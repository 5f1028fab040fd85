"""Mixture of experts with expert parallelism (``model.ffn=moe``, ``parallel.ep``): see ``plugin``."""
