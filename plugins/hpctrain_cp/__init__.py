"""Context parallelism: ring attention (zigzag balanced) and the all-gather variant; see ``plugin``."""
