"""``parallel.pipeline.layers``: the ``auto`` split (``hpctrain.pipeline.split``)
that the pipeline plugin makes and the planner assumes."""
from __future__ import annotations

import itertools

import pytest

from hpctrain.model.shapes import ModelShape
from hpctrain.pipeline.split import auto_counts, layer_counts, model_end_cost, rank_layers, stage_layers

LLAMA3_405B = ModelShape(128256, 16384, 126, 128, 8, 53248, False)
LLAMA3_8B = ModelShape(128256, 4096, 32, 32, 8, 14336, False)


def test_llama3_405b_on_16_stages_takes_a_block_off_each_end():
    """Meta's split for 405B on pp 16: the first and last stage hold one block
    fewer, balancing the embedding and the head (each 0.66 of a block's
    parameters)."""
    ends = model_end_cost(LLAMA3_405B)
    assert ends == pytest.approx(128256 * 16384 / LLAMA3_405B.block_params) and 0.65 < ends < 0.67
    assert auto_counts(126, 16, ends) == [7] + [8] * 14 + [7]
    assert stage_layers("auto", 126, 16, ends)[0] == list(range(7))
    assert stage_layers("auto", 126, 16, ends)[-1] == list(range(119, 126))


def test_a_large_vocabulary_moves_blocks_off_the_end_stages():
    """Llama 3 8B: the 128k-token table weighs 2.4 blocks, so on pp 4 the end
    stages take 7 blocks and the middle ones 9 (the even split's end stages
    would cost 10.4)."""
    ends = model_end_cost(LLAMA3_8B)
    assert 2.3 < ends < 2.5
    assert auto_counts(32, 4, ends) == [7, 9, 9, 7]
    assert auto_counts(32, 4) == [8, 8, 8, 8]


@pytest.mark.parametrize("n,stages,want", [
    (8, 4, [2, 2, 2, 2]), (10, 4, [2, 3, 3, 2]), (11, 4, [3, 3, 3, 2]), (7, 3, [2, 3, 2]), (5, 5, [1] * 5),
    (9, 2, [5, 4]), (4, 1, [4]),
])
def test_without_end_cost_the_remainder_goes_to_the_middle(n, stages, want):
    """End costs below one block change nothing: the even split, the remainder
    on the middle stages (outward from the centre)."""
    assert auto_counts(n, stages) == want
    assert auto_counts(n, stages, 0.9) == want


@pytest.mark.parametrize("ends", [0.0, 0.5, 1.3, 2.4])
def test_auto_is_the_cheapest_split(ends):
    """No split of n blocks over the stages (each >= 1) has a costliest stage
    (blocks, plus ``ends`` on the first and last) cheaper than auto's: every
    composition checked for n <= 12 and up to 5 stages."""
    def worst(counts):
        cost = [float(c) for c in counts]
        cost[0] += ends
        cost[-1] += ends
        return max(cost)

    for stages in range(1, 6):
        for n in range(stages, 13):
            got = auto_counts(n, stages, ends)
            assert sum(got) == n and min(got) >= 1
            best = min(worst(c) for c in itertools.product(range(1, n + 1), repeat=stages) if sum(c) == n)
            assert worst(got) == pytest.approx(best), (n, stages, got)


def test_lists_and_their_errors():
    assert layer_counts([3, 5, 5, 3], 16, 4) == [3, 5, 5, 3]
    assert layer_counts("3,5,5,3", 16, 4) == [3, 5, 5, 3]
    with pytest.raises(ValueError, match="needs 4 counts"):
        layer_counts([3, 5, 5], 16, 4)
    with pytest.raises(ValueError, match="neither auto nor block counts"):
        layer_counts("even", 16, 4)
    with pytest.raises(ValueError, match="cannot give each of the 5 pipeline stages"):
        auto_counts(4, 5)


def test_rank_layers_sums_each_ranks_virtual_stages():
    """Rank r runs virtual stages r, r + p, ...: [1, 2 x 62, 1] on pp 16 x vpp 4
    gives the end ranks 7 blocks and the others 8."""
    counts = auto_counts(126, 64, model_end_cost(LLAMA3_405B))
    assert counts == [1] + [2] * 62 + [1]
    assert rank_layers(counts, 16) == [7] + [8] * 14 + [7]
