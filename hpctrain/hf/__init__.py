"""Hugging Face models in and out: ``config.json`` to a model shape (``config``),
logical tensor names to Hugging Face's (``names``), lazy per-rank reads of
safetensors (``weights``) and the directory an export writes (``export``).

The exactness check is ``transformers``' own forward (tests/unit/hf,
tests/mpi/test_hf.py). ``safetensors`` is imported only where tensors are
read or written (the ``hf`` extra).
"""

PREFIX = "hf:"
"""What ``checkpoint.init_from`` starts with to name a Hugging Face directory (``hf:DIR``)."""
