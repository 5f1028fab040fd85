"""``hpctrain-tune``: measure the allocation, re-rank the planner's layouts with what was measured,
train the best few for real in the same job, print the fastest measured layout's command.

    measure.py   matmul throughput at the model's shapes; latency and bus bandwidth of each axis's groups
    rank.py      the planner with that calibration (and without, for the report)
    trial.py     one layout trained for a few steps through hpctrain-train's own code path
    report.py    the table, the rank correlation, the JSON, the winning command
    cli.py       the command, rank 0 deciding and broadcasting, every rank measuring and training
"""
