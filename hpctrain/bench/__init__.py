"""Benchmarks (not tests): each runs hpctrain and its peer in the same run and reports ratios."""
