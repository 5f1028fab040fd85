"""Data parallelism: replicas average their gradients over the dp group, in
buckets whose reductions overlap with backward (see ``plugin`` and ``reducer``)."""
