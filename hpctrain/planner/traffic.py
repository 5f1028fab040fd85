"""Bytes on the wire per step, per axis, for one pipeline rank: the one definition.

"Bytes" are nccl-tests bus bytes, as every Communicator counts them
(``hpctrain.comm.counting``; the dry run's recording backend,
``plugins/hpctrain_comm_record``, the same): an all-reduce of S bytes over n
ranks moves 2 (n-1)/n S, an all-gather (n-1)/n of its output, a
reduce-scatter (n-1)/n of its input, an all-to-all what the rank sends to
the others, a send its tensor and a receive nothing. The planner's
``Estimate.comm_bytes`` is ``stage_bytes`` of the slowest stage, and
``hpctrain-train --dry-run`` prints ``stage_bytes`` of each rank's stage
beside what the rank recorded (tests/unit/test_dry_run_vs_planner.py).

Per micro-batch (m per step) on one GPU, with T its tokens (micro-batch x
sequence / cp), h the width, e the activation and r the residual stream's
bytes (``activations.dtypes_for``: hpctrain keeps the residual stream fp32
under bf16 autocast, so the input gradients tp reduces, the pipeline's sends
and the MoE dispatch move 4-byte elements):

- tp, per sub-layer (attention; dense MLP): with sequence parallelism an
  all-gather of the input (T h e: cast before the gather,
  ``plugins/hpctrain_tp/columns.py``) and a reduce-scatter of the
  row-parallel output (T h e) forward; backward the output gradient's
  all-gather (T h e), the input's re-gather (T h e) and the input gradient's
  reduce-scatter (T h r: summed in the input's dtype); without it an
  all-reduce forward (T h e) and one of the input gradient backward (T h r). Each norm
  weight's gradient is all-reduced (fp32) under sequence parallelism. An MoE
  block's experts and router are replicated over tp: under sequence
  parallelism every micro-batch all-reduces their fp32 gradients and the
  routing statistics. The first stage's vocab-parallel embedding leaves the
  region (T h r forward; its gradient gathered back), the last stage's head
  enters it like a column projection and the loss all-reduces three fp32
  values per token. A full recomputation repeats the forward's collectives.
- cp (ring attention, ``plugins/hpctrain_cp/ring.py``): per block the
  key/value block (2 T kv e) is sent on cp-1 times forward and again
  backward, and the fp32 key/value gradient accumulator cp times.
- ep: per MoE block the dispatch (T k h rows of r bytes, forward and its
  gradient backward) and the combine (e bytes, both ways), each an
  all-to-all sending (ep-1)/ep of the rows (the even spread a balanced router
  gives), and an all-to-all of the per-expert counts (int64).
- pp: the sends of this rank: a forward send per micro-batch from every
  chunk but the model's last, a backward send from every chunk but the
  first (T h r / tp under sequence parallelism each); with tied embeddings
  the two ends all-reduce the table's gradient.
- dp: the data axes' gradient reduction and ZeRO's gathers of this stage's
  parameters (``dp_bytes``).

Other codes (``Framework``, for validation) move 16-bit residuals and
key/value gradients, on the same counts.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

from hpctrain.planner import activations as act
from hpctrain.planner.arch import Arch
from hpctrain.planner.comm_model import bus_factor
from hpctrain.planner.layouts import Layout
from hpctrain.planner.lora import LoraPlan, rank_adapters, stage_adapters
from hpctrain.planner.stages import rank_blocks, stage_params
from hpctrain.planner.workload import Workload

AXES = ("tp", "cp", "ep", "pp", "dp")
FP32 = 4
INT64 = 8


def _sub_layer_tp(lay: Layout, tokens: float, h: int, e: float, r: float) -> Tuple[float, float]:
    """(forward, backward) bus bytes of one tensor-parallel sub-layer for one micro-batch."""
    n = lay.tp
    act, resid = tokens * h * e, tokens * h * r
    if lay.sp:  # gathers of the input (cast first) and the output's gradient; the input gradient in r
        ag, rs = bus_factor("all_gather", n), bus_factor("reduce_scatter", n)
        return act * ag + act * rs, act * ag + act * ag + resid * rs
    return act * bus_factor("all_reduce", n), resid * bus_factor("all_reduce", n)


def tp_bytes(arch: Arch, lay: Layout, tokens: float, e: float, r: float, layers: int, moe: int, first: bool,
             last: bool, lora: Optional[LoraPlan] = None) -> float:
    """Tensor-parallel bus bytes of one micro-batch on a stage of ``layers`` blocks (``moe`` of them MoE);
    with ``lora`` the base is frozen (``planner.lora``)."""
    if lay.tp == 1:
        return 0.0
    n, h = lay.tp, arch.d_model
    ar = bus_factor("all_reduce", n)
    f1, b1 = _sub_layer_tp(lay, tokens, h, e, r)
    dense = layers - moe
    fwd = (2 * dense + moe) * f1
    bwd = (2 * dense + moe) * b1
    trains_base = lora is None
    if lay.sp:
        if trains_base:
            bwd += layers * arch.norm_params * FP32 * ar  # the norms' weight gradients, partial over the shards
        # MoE under sequence parallelism: experts and router replicated over tp, gradients summed every micro-batch
        replicated = arch.expert_params_per_rank(lay.ep) + arch.shared_experts * arch.expert_params \
            + arch.router_params
        stats = (2 * arch.num_experts + 1) * FP32  # assignment counts, probability sums, z-loss term
        bwd += moe * (replicated * FP32 * ar) if trains_base else 0.0
        fwd += moe * stats * ar
    if lora is not None:  # each whole A (column) or B (row) has its gradient summed over tp (copy_to_region)
        bwd += stage_adapters(arch, n, layers, moe, lora)[1] * FP32 * ar
    if lay.recompute == "full":
        fwd *= 2
    total = fwd + bwd
    if first:  # the vocab-parallel embedding leaves the region (its output: the residual stream's dtype)
        total += (tokens * h * r * bus_factor("reduce_scatter", n) + tokens * h * r * bus_factor("all_gather", n)
                  if lay.sp else tokens * h * r * ar)
        if lora is not None:  # nothing flows back into the frozen embedding: its backward collective and the
            # first block's input-gradient one are not issued
            total -= (tokens * h * r * (bus_factor("reduce_scatter", n) + bus_factor("all_gather", n))
                      if lay.sp else tokens * h * r * ar)
    if last:  # final norm's weight, the head's column projection and the loss's three reductions
        if lay.sp:
            ag, rs = bus_factor("all_gather", n), bus_factor("reduce_scatter", n)
            total += arch.final_norm_params * FP32 * ar + tokens * h * (2 * e * ag + r * rs)
        else:
            total += tokens * h * r * ar
        total += 3 * tokens * FP32 * ar
    return total


def cp_bytes(arch: Arch, lay: Layout, tokens: float, e: float, ours: bool, layers: int) -> float:
    """Ring attention's bus bytes of one micro-batch on a stage of ``layers`` blocks."""
    n = lay.cp
    if n == 1:
        return 0.0
    kv = 2 * tokens * arch.kv_dim_per_rank(lay.tp)
    fwd = (n - 1) * kv * e
    bwd = (n - 1) * kv * e + (n * kv * FP32 if ours else (n - 1) * kv * e)
    if lay.recompute == "full":
        fwd *= 2
    return layers * (fwd + bwd)


def ep_bytes(arch: Arch, lay: Layout, tokens: float, e: float, r: float, moe: int) -> float:
    """Expert-parallel bus bytes of one micro-batch on a stage with ``moe`` MoE blocks."""
    n = lay.ep
    if n == 1 or not moe:
        return 0.0
    rows = tokens / (lay.tp if lay.sp else 1) * arch.top_k * arch.d_model
    a2a = bus_factor("all_to_all", n)
    fwd = rows * (r + e) * a2a + arch.num_experts * INT64 * a2a
    if lay.recompute == "full":
        fwd *= 2
    return moe * (fwd + rows * (r + e) * a2a)


def pp_bytes(arch: Arch, lay: Layout, tokens: float, r: float, m: int, rank: int) -> float:
    """This pipeline rank's sends per step (and the tied embedding's reduction at the ends)."""
    p, v = lay.pp, lay.vpp
    if p == 1:
        return 0.0
    one = tokens * arch.d_model * r / (lay.tp if lay.sp else 1)
    stages = [c * p + rank for c in range(v)]
    sends = sum(1 for s in stages if s < p * v - 1) + sum(1 for s in stages if s > 0)
    total = m * sends * one
    if arch.tie_embeddings and rank in (0, p - 1):
        total += arch.padded_vocab(lay.tp) // lay.tp * arch.d_model * FP32 * bus_factor("all_reduce", 2)
    return total


def dp_bytes(arch: Arch, lay: Layout, work: Workload, m: int, rank: int) -> float:
    """The data axes' bus bytes per step for this stage's parameters: dense ones over cp x ep x dp, routed
    experts over cp x dp. ZeRO 0 all-reduces the gradients; 1 (and 2 under a pipeline) reduce-scatters
    them once and all-gathers the parameters; 2 reduce-scatters every micro-batch; 3 gathers every
    forward and backward (under a pipeline the reduce-scatter once). hpctrain gathers its fp32
    parameters, FSDP2 and Megatron's distributed optimizer 16-bit ones."""
    dense, expert, _ = stage_params(arch, lay, rank)
    sb, fw = work.state_bytes, work.framework
    if work.lora is not None:
        return _lora_dp_bytes(arch, lay, work, m, rank, dense, expert)
    total = 0.0
    for params, n in ((dense, lay.cp * lay.ep * lay.dp), (expert, lay.cp * lay.dp)):
        if n == 1 or params == 0:
            continue
        grads, weights = params * sb.grads, params * (sb.weights if fw.ours else 2.0)
        half = bus_factor("all_gather", n)
        if lay.zero == 0:
            total += grads * bus_factor("all_reduce", n)
        elif lay.zero == 1 or (lay.zero == 2 and lay.pp > 1):
            total += (grads + weights) * half
        elif lay.zero == 2:
            total += (m * grads + weights) * half
        elif lay.pp > 1:
            total += (m * 2 * weights + grads) * half
        else:
            total += m * (2 * weights + grads) * half
    return total


def _lora_dp_bytes(arch: Arch, lay: Layout, work: Workload, m: int, rank: int, dense: float, expert: float
                   ) -> float:
    """``dp_bytes`` of a LoRA run: only the adapters are reduced (and, under ZeRO 1-2, gathered after the
    step); ZeRO 3 still gathers the frozen weights for every forward and backward."""
    assert work.lora is not None
    adapters = rank_adapters(arch, lay, work.lora, rank)[0]
    sb, fw = work.state_bytes, work.framework
    wbytes = sb.weights if fw.ours else 2.0
    n_dense, n_expert = lay.cp * lay.ep * lay.dp, lay.cp * lay.dp
    grads, total = adapters * sb.grads, 0.0
    if n_dense > 1:
        half = bus_factor("all_gather", n_dense)
        if lay.zero == 0:
            total += grads * bus_factor("all_reduce", n_dense)
        elif lay.zero == 1 or (lay.zero == 2 and lay.pp > 1):
            total += (grads + adapters * wbytes) * half
        elif lay.zero == 2:
            total += (m * grads + adapters * wbytes) * half
        else:
            gathers = m * 2 * (dense + adapters) * wbytes  # forward and backward, every micro-batch
            total += (gathers + (grads if lay.pp > 1 else m * grads)) * half
    if lay.zero == 3 and n_expert > 1 and expert:
        total += m * 2 * expert * wbytes * bus_factor("all_gather", n_expert)
    return total


def stage_bytes(arch: Arch, lay: Layout, work: Workload, rank: int) -> Dict[str, float]:
    """Bus bytes one GPU of pipeline rank ``rank`` puts on the wire per step, per axis (module docstring)."""
    d = act.dtypes_for(arch, work.precision, work.framework.activations)
    e, r = float(d.act), float(d.resid)
    m = lay.microbatches(work.global_batch)
    tokens = lay.micro_batch * work.seq_len / lay.cp
    blocks = rank_blocks(arch, lay, rank)
    layers = sum(len(b) for b in blocks)
    moe = sum(arch.moe_layers_in(b.start, b.stop) for b in blocks)
    first, last = rank == 0, rank == lay.pp - 1
    return {
        "tp": m * tp_bytes(arch, lay, tokens, e, r, layers, moe, first, last, work.lora),
        "cp": m * cp_bytes(arch, lay, tokens, e, work.framework.ours, layers),
        "ep": m * ep_bytes(arch, lay, tokens, e, r, moe),
        "pp": pp_bytes(arch, lay, tokens, r, m, rank),
        "dp": dp_bytes(arch, lay, work, m, rank),
    }
