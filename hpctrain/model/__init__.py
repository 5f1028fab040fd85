"""The reference model family: a Llama-style decoder-only transformer.

``shapes`` (closed-form shapes and counts, no torch) is imported by the
planner; ``build`` and ``transformer`` need torch. Import the submodule you
need; this package imports nothing eagerly.
"""
