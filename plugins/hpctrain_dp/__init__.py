"""Data parallelism: replicas average their gradients over the dp group."""
