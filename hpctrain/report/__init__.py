"""``hpctrain-report RUN_DIR``: one self-contained HTML page of a run, or of a sweep.

The page needs no network and no other file: plots are inline SVG drawn
here (``svg``), the pipeline timeline picture is embedded as a PNG data
URI. A run's page (``page.run_page``) has the loss and validation loss,
learning-rate, gradient-norm, throughput and MFU curves; the layout and its
groups; peak memory per rank; bytes per axis against the planner's
prediction for the same config (``predict``); stragglers, skipped steps and
loss spikes; the pipeline timeline when the run has one. A sweep's page
(``page.sweep_page``) puts the points side by side: a table, every point's
loss curve, and the final loss against each swept key.

It reads what a run leaves in its directory (``data``): ``metrics.jsonl``,
``.hydra/config.yaml``, ``layout.json`` and ``memory_per_rank.json``
(rank 0 writes them), ``pipeline_timeline.png``; a sweep directory holds
numbered point directories (and ``summary.jsonl``).
"""
