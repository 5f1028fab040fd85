"""Context-parallel settings are checked before any collective, with the fix in the message."""
from __future__ import annotations

from hpctrain.config.validate import validate


def test_unknown_implementation(make_config, pm):
    problems = validate(make_config("parallel.cp=2", "parallel.cp_impl=ulysses"), 2, pm)
    assert any("parallel.cp_impl='ulysses': choose one of ring, allgather" in p for p in problems)


def test_sequence_not_divisible_by_twice_cp_names_the_nearest_lengths(make_config, pm):
    problems = validate(make_config("parallel.cp=2", "trainer.seq_len=30", "trainer.global_batch_size=4"), 2, pm)
    assert any("trainer.seq_len=30 is not divisible by 2 x parallel.cp = 4" in p and "28 or 32" in p
               for p in problems)
    assert validate(make_config("parallel.cp=2", "trainer.seq_len=32", "trainer.global_batch_size=4"), 2, pm) == []
