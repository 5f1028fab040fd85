"""Pipeline rules, defined once: each rank's program for a schedule
(``schedules``), which blocks each stage holds (``split``), the programs
played on paper (``simulate``) and the bubble and in-flight formulas
(``bubble``). The pipeline plugin runs them; the planner, the timeline and
the benchmarks read the same definitions."""
