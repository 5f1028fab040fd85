"""What a multi-rank run reports about itself: every rank's peak memory
gathered (min, max, the rank holding the max), tokens/s per device against
the global figure, a profiler trace only on the chosen rank, and logger
backends written by rank 0 alone."""
from __future__ import annotations

import os

import pytest

from hpctrain.run import prepare_run
from hpctrain.train.memory import peak_rss_bytes

EXTRA_MIB = 64
"""Rank r holds r x this much more memory, so the ranks' peaks are told apart."""


@pytest.mark.mpi(min_size=2)
def test_peak_memory_per_rank_per_device_rates_and_a_trace_on_the_chosen_rank(world, shared_tmp, make_config):
    n, rank = world.Get_size(), world.Get_rank()
    last = n - 1
    cfg = make_config("trainer.steps=2", f"trainer.global_batch_size={4 * n}", "trainer.micro_batch_size=4",
                      "trainer.log_every=1", "cluster.peak_tflops=0.1", "trainer.profile.steps=[2]",
                      f"trainer.profile.ranks=[{last}]", "logging.backends=[jsonl,tensorboard]",
                      "trainer.progress=off")
    trainer = prepare_run(cfg, shared_tmp)
    ballast = bytearray(rank * EXTRA_MIB * 2**20)
    ballast[::4096] = b"x" * len(ballast[::4096])  # touch every page: resident
    history = trainer.fit()
    now = peak_rss_bytes()
    peaks = trainer.peaks_per_rank["peak_rss_bytes"]
    measured = world.allgather((history[-1]["peak_rss_bytes"], now))
    assert len(peaks) == n
    for r, (before, after) in enumerate(measured):
        assert before <= peaks[r] <= after, (r, before, peaks[r], after)  # rank r's own figure, in rank order
    m = history[-1]
    assert m["peak_rss_bytes.max"] == max(peaks) and m["peak_rss_bytes.min"] == min(peaks)
    assert m["peak_rss_bytes.max_rank"] == last  # the ballast: the last rank holds the most
    for rec in history:
        assert rec["tokens_per_s_per_device"] == pytest.approx(rec["tokens_per_s"] / n, rel=1e-12)
        assert rec["mfu"] == pytest.approx(rec["model_tflops_per_device"] / 0.1, rel=1e-12)
    del ballast
    world.Barrier()
    assert sorted(os.listdir(os.path.join(shared_tmp, "profile"))) == [f"rank{last}.steps2-2.json"]
    events = os.listdir(os.path.join(shared_tmp, "tensorboard", os.path.basename(shared_tmp)))
    assert len(events) == 1 and events[0].startswith("events.out.tfevents"), events  # rank 0 alone
    if rank == 0:
        import json

        peaks_file = json.load(open(os.path.join(shared_tmp, "memory_per_rank.json")))
        assert peaks_file["peak_rss_bytes"] == peaks
