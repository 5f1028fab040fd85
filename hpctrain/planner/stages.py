"""What one pipeline rank holds: its blocks (one range per virtual stage)
and its parameters on one GPU. The one count both the memory estimate
(``estimate``) and the bytes per axis (``traffic``) use."""
from __future__ import annotations

from functools import lru_cache
from typing import List, Tuple

from hpctrain.planner.arch import Arch
from hpctrain.planner.layouts import Layout, planned_layers


def rank_blocks(arch: Arch, lay: Layout, rank: int) -> List[range]:
    """The block indices pipeline rank ``rank`` holds, one range per virtual stage (chunk)."""
    starts = [0]
    for c in planned_layers(arch, lay):
        starts.append(starts[-1] + c)
    return [range(starts[s], starts[s + 1]) for s in range(rank, len(starts) - 1, lay.pp)]


def stage_params(arch: Arch, lay: Layout, rank: int) -> Tuple[float, float, int]:
    """(dense, expert, tensors) parameters on one GPU of pipeline rank ``rank``."""
    blocks = tuple((b.start, b.stop) for b in rank_blocks(arch, lay, rank))
    return _stage_params(arch, lay.tp, lay.ep, lay.pp, blocks, rank == 0, rank == lay.pp - 1)


@lru_cache(maxsize=4096)
def _stage_params(arch: Arch, tp: int, ep: int, pp: int, blocks: Tuple[Tuple[int, int], ...], first: bool,
                  last: bool) -> Tuple[float, float, int]:
    h = arch.d_model
    layers = sum(stop - start for start, stop in blocks)
    moe = sum(arch.moe_layers_in(start, stop) for start, stop in blocks)
    expert = moe * arch.expert_params_per_rank(ep)
    dense = (moe * arch.layer_params_per_rank(tp, ep) + (layers - moe) * arch.layer_params_per_rank(tp, ep, moe=False)
             - expert)
    tensors = moe * arch.param_tensors_per_layer(ep) + (layers - moe) * arch.param_tensors_per_layer(ep, moe=False)
    vocab_shard = arch.padded_vocab(tp) // tp * h
    if first:
        dense += vocab_shard + arch.positions * h
        tensors += 1 + (1 if arch.positions else 0)
    if last:
        dense += arch.final_norm_params
        tensors += 1 if arch.final_norm_params else 0
        if not arch.tie_embeddings or pp > 1:  # a tied table is copied to the last stage
            dense += vocab_shard
            tensors += 1
        if arch.mtp_depth:  # the MTP modules sit beside the head, which then holds the embedding too
            moe_mtp = arch.mtp_depth if arch.mtp_is_moe else 0
            mtp_expert = moe_mtp * arch.expert_params_per_rank(ep)
            dense += arch.mtp_depth * (arch.layer_params_per_rank(tp, ep, moe=arch.mtp_is_moe) + 2 * h * h + 3 * h) \
                - mtp_expert
            expert += mtp_expert
            tensors += arch.mtp_depth * (arch.param_tensors_per_layer(ep, moe=arch.mtp_is_moe) + 4)
            if pp > 1 and not first:
                dense += vocab_shard
                tensors += 1
    return dense, expert, tensors
