"""One layout's prediction: memory per GPU and step time, with their breakdowns.

Pipeline stages hold the blocks of ``Layout.layers`` (uneven where the
blocks do not divide; ``hpctrain.pipeline.split``). Memory is evaluated on
the first and the last stage (the first holds the most in-flight
micro-batches and the embedding, the last the output layer and loss) and on
the earliest middle stage of each block count (a later stage with as many
blocks holds fewer micro-batches), and the largest is reported. Time per step:

    pipeline = m * (t_f + t_b) + bubble(schedule)     (slowest stage's t_f, t_b;
                                                       bubble from every stage's, stage_bubble_time)
    step     = pipeline + exposed data-parallel comm + pipeline p2p

t_f and t_b hold the stage's compute plus its tensor- and expert-parallel
collectives (blocking, on the critical path) and the part of ring-attention
traffic that the attention compute does not hide. Data-parallel traffic is
bucketed (``comm.bucket_mb``) and overlaps the backward of the last
micro-batch (ZeRO 0/1), each micro-batch's backward (ZeRO 2) or each forward
and backward (ZeRO 3), except one bucket each time (the first gather or the
last reduction has no compute left to hide behind); the ZeRO 1/2 parameter
all-gather after the optimizer step is exposed. Under a pipeline, whose
micro-batches' backwards interleave, ZeRO 2/3 accumulate the stage's whole
gradient (counted in buffers) and reduce-scatter it once per step, as ZeRO 1. Pipeline p2p is
counted un-overlapped, 2 (m v + p - 1) transfers. The optimizer step itself
(memory bound) and pointwise kernels are not modelled: predictions are
optimistic, and calibration narrows the gap.
"""
from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Any, Callable, Dict, List, Tuple

from hpctrain.mesh import DEFAULT_ORDER, parse_order
from hpctrain.pipeline.bubble import in_flight, peak_held, stage_bubble_time
from hpctrain.planner import activations as act
from hpctrain.planner.arch import Arch
from hpctrain.planner.cluster import ClusterSpec
from hpctrain.planner.comm_model import flat_time, group_time
from hpctrain.planner.compute import lora_model_flops_per_token, model_flops_per_token, recompute_flops_per_token
from hpctrain.planner.frameworks import Framework
from hpctrain.planner.kernels import (
    Gemm,
    adapter_cost,
    block_cost,
    embedding_cost,
    gemm_time,
    head_cost,
    optimizer_bytes,
    param_pass_bytes,
    pass_time,
)
from hpctrain.planner.layouts import Layout, per_rank_layers
from hpctrain.planner.lora import adapter_params, rank_adapters
from hpctrain.planner.memory import ModelStates, model_states
from hpctrain.planner.stages import rank_blocks, stage_params
from hpctrain.planner.traffic import stage_bytes
from hpctrain.planner.workload import Workload


@dataclass
class Memory:
    """Bytes per GPU on the worst pipeline stage."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    """bf16 weight copies kept by autocast, ZeRO-3 gathered layers, recompute working set."""
    stage: int

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.buffers


@dataclass
class StepTime:
    """Seconds per optimizer step, and the exposed communication per axis."""

    compute: float
    bubble: float
    exposed: Dict[str, float]
    optimizer: float = 0.0
    """The optimizer step (memory-bound: bytes over HBM bandwidth), after the last backward."""
    contention: float = 0.0
    """What hidden communication costs the compute it hides behind (``overlap_contention``)."""

    @property
    def total(self) -> float:
        return self.compute + self.bubble + sum(self.exposed.values()) + self.optimizer + self.contention


@dataclass
class Estimate:
    layout: Layout
    memory: Memory
    time: StepTime
    fits: bool
    microbatches: int
    bubble_fraction: float
    mfu: float
    tokens_per_s: float
    comm_bytes: Dict[str, float] = field(default_factory=dict)
    """Bytes each GPU puts on the wire per step, per axis (nbytes x busbw factor)."""
    comm_time: Dict[str, float] = field(default_factory=dict)
    """Seconds each axis's collectives take per step if nothing overlapped them
    (the wire time); ``time.exposed[axis]`` is never less than this minus the
    step's compute."""

    def to_dict(self) -> dict:
        out = asdict(self)
        out["memory"]["total"] = self.memory.total
        out["time"]["total"] = self.time.total
        return out


@lru_cache(maxsize=4096)
def group_span(sizes: Tuple[Tuple[str, int], ...], axes: Tuple[str, ...], gpus_per_node: int,
               order: str = DEFAULT_ORDER) -> Tuple[int, int]:
    """(members per node, nodes) of rank 0's group over ``axes``, ranks filling nodes in order."""
    size_of = dict(sizes)
    stride, members = 1, [0]
    for axis in parse_order(order):
        if axis in axes:
            members = [r + i * stride for i in range(size_of[axis]) for r in members]
        stride *= size_of[axis]
    nodes = {r // gpus_per_node for r in members}
    return len(members) // len(nodes), len(nodes)


def stage_memory(arch: Arch, lay: Layout, work: Workload, stage: int) -> Memory:
    """Bytes per GPU on pipeline stage ``stage`` (0 .. pp - 1)."""
    m = lay.microbatches(work.global_batch)
    first, last = stage == 0, stage == lay.pp - 1
    dense, expert, tensors = stage_params(arch, lay, stage)
    sb = work.state_bytes
    trained = dense + expert  # parameters with gradients and optimizer state
    if work.lora is not None:  # the base keeps its weights only (ZeRO 3 shards them too); the adapters train
        trained, _, tensors = rank_adapters(arch, lay, work.lora, stage)
        z3 = lay.zero == 3
        frozen = (dense / (lay.dp * lay.cp * lay.ep if z3 else 1) + expert / (lay.dp * lay.cp if z3 else 1))
        states = ModelStates(frozen * sb.weights, 0.0, 0.0) + model_states(trained, lay.zero,
                                                                          lay.dp * lay.cp * lay.ep, sb, tensors)
    else:
        states = model_states(dense, lay.zero, lay.dp * lay.cp * lay.ep, sb, tensors)
        if expert:
            states = states + model_states(expert, lay.zero, lay.dp * lay.cp, sb)
    fw = work.framework
    kw: Dict[str, Any] = dict(tp=lay.tp, cp=lay.cp, sp=lay.sp, profile=fw.activations,
                              flash=fw.attention == "flash", dropout=fw.dropout)
    per_layer = act.layer_bytes(arch, work.precision, lay.micro_batch, work.seq_len, recompute=lay.recompute, **kw)
    # per chunk (virtual stage) and micro-batch: its blocks and RoPE tables; the embedding's token ids on the
    # model's first chunk, the final norm and loss on its last; held as the schedule holds them (peak_held)
    chunks = rank_blocks(arch, lay, stage)
    layers = sum(len(b) for b in chunks)

    def extra(first_chunk: bool, last_chunk: bool) -> float:
        return act.stage_extra_bytes(arch, work.precision, lay.micro_batch, work.seq_len, lay.tp, lay.cp, lay.sp,
                                     first_chunk, last_chunk, profile=fw.activations)

    weights = [len(b) * per_layer + extra(first and c == 0, last and c == len(chunks) - 1)
               for c, b in enumerate(chunks)]
    activations = peak_held(lay.schedule, lay.pp, lay.vpp, m, stage, weights)
    buffers = 0.0
    if lay.recompute == "full":  # one block rematerialised during its backward
        buffers += act.layer_bytes(arch, work.precision, lay.micro_batch, work.seq_len, recompute="none", **kw)
    layer_params = arch.layer_params_per_rank(lay.tp, lay.ep)
    layer_trained = (layer_params if work.lora is None
                     else adapter_params(arch, work.lora, lay.tp, moe_block=arch.is_moe)[0])
    # under a pipeline the micro-batches' backwards interleave, so ZeRO-2/3 accumulate the stage's whole
    # gradient through the step (reduce-scattered once, after the last backward)
    whole_grads = lay.zero >= 2 and lay.pp > 1
    if whole_grads:
        buffers += trained * sb.grads
    if lay.zero == 3:
        # the gathered current + prefetched block (under a pipeline also the stage's last block, kept for
        # its backward while the next micro-batch's forward gathers); one block's full gradient
        gathered = (3 if lay.pp > 1 else 2) * layer_params
        if fw.ours:
            buffers += gathered * sb.weights + (0 if whole_grads else layer_trained * sb.grads)
            buffers += act.autocast_weight_copy_bytes(gathered, work.precision)
        else:  # FSDP2 mixed precision gathers bf16 parameters and reduces a bf16 gradient cast to fp32
            buffers += gathered * 2 + (0 if whole_grads else layer_trained * (2 + sb.grads))
    elif fw.ours:
        held = in_flight(lay.schedule, lay.pp, lay.vpp, m, stage)
        saved = 0.0 if lay.recompute == "full" else layers * _autocast_saved_per_layer(arch, lay)
        buffers += act.autocast_weight_copy_bytes(dense + expert, work.precision, saved, held)
    return Memory(states.weights, states.grads, states.optimizer, activations, buffers, stage)


def _autocast_saved_per_layer(arch: Arch, lay: Layout) -> float:
    """Weights of one block whose autocast copies a micro-batch's backward keeps (hpctrain's code): with
    sequence parallelism the row-parallel projections (wo, w2; the column ones run in the tp plugin's own
    autograd function, which saves the fp32 weight), otherwise every projection (``F.linear``)."""
    h, hq, kv, f = arch.d_model, arch.d_model // lay.tp, arch.kv_dim_per_rank(lay.tp), arch.ffn_hidden // lay.tp
    matrices = 3 if arch.family == "llama" else 2
    rows = h * hq + h * (arch.moe_token_ffn if arch.is_moe else f)
    if lay.sp:
        return rows
    return rows + h * (hq + 2 * kv) + (matrices - 1) * h * f


def memory_stages(arch: Arch, lay: Layout) -> List[int]:
    """The pipeline ranks whose memory can be the largest: the first, the last and, in
    between, the earliest of each block count (in-flight micro-batches fall with the rank)."""
    counts = per_rank_layers(arch, lay)
    earliest: Dict[int, int] = {}
    for r in range(1, lay.pp - 1):
        earliest.setdefault(counts[r], r)
    return sorted({0, lay.pp - 1, *earliest.values()})


def memory_per_gpu(arch: Arch, lay: Layout, work: Workload) -> Memory:
    """Bytes per GPU on the fullest pipeline stage (``memory_stages``)."""
    return max((stage_memory(arch, lay, work, s) for s in memory_stages(arch, lay)),
               key=lambda mem: mem.total)


def _time(cluster: ClusterSpec, axis: str, kind: str, nbytes: float, n_in: int, n_out: int) -> float:
    """One collective of ``axis`` over ``n_in`` GPUs per node on ``n_out`` nodes: on the axis's
    measured link when the calibration has one, else the two-level intra/inter model."""
    link = cluster.axis_links.get(axis)
    if link is not None:
        return flat_time(kind, nbytes, n_in * n_out, link)
    return group_time(kind, nbytes, n_in, n_out, cluster.intra, cluster.inter)


def _tp_collectives(lay: Layout, fw: Framework, tokens: float, h: int, e: float, r: float,
                    gemm: Dict[str, Tuple[float, float, float]],
                    coll: Callable[[str, float], float]) -> Tuple[float, float, float, float]:
    """Tensor-parallel collectives of one block for one micro-batch: (exposed forward, exposed backward,
    exposed in a full recomputation, seconds if nothing overlapped); their bytes: ``traffic.tp_bytes``.

    Per sub-layer (attention, MLP): under sequence parallelism an all-gather of the input before the
    column-parallel GEMMs and a reduce-scatter after the row-parallel one; backward the all-gather of the
    output gradient, the re-gather of the input (both hpctrain's tp plugin and Megatron keep only the
    shard) and the reduce-scatter of the input gradient. Without it an all-reduce after the row-parallel
    GEMM forward and of the input gradient backward. Which GEMM hides which collective is the
    framework's (``Framework.tp_overlap``): none; Megatron-LM 2022's backward (the re-gather behind the
    input-gradient GEMM, the input-gradient reduction behind the weight-gradient GEMM); or all of them
    behind their neighbouring GEMM (TE userbuffers, torch async TP). hpctrain gathers the sub-layer input
    cast to 16 bits, as the others do, but reduces its input gradient in the residual stream's dtype
    (fp32: ``r``)."""
    if lay.tp == 1:
        return 0.0, 0.0, 0.0, 0.0
    entry, exit_ = tokens * h * (r if fw.ours else e), tokens * h * e

    def g(names: Tuple[str, ...], i: int) -> float:
        return sum(gemm[n][i] for n in names if n in gemm)

    cols = [("qkv", "q", "k", "v"), ("fc1", "gate_up", "gate", "up")]
    rows = [("proj",), ("fc2",)]
    fwd: List[Tuple[str, float, float]] = []  # (kind, bytes, the GEMM that may hide it)
    bwd: List[Tuple[str, float, float, bool]] = []  # (..., overlapped under "backward")
    for col, row in zip(cols, rows):
        if lay.sp:
            fwd += [("all_gather", exit_, g(col, 0)), ("reduce_scatter", exit_, g(row, 0))]
            bwd += [("all_gather", exit_, g(row, 1), False), ("all_gather", exit_, g(col, 1), True),
                    ("reduce_scatter", entry, g(col, 2), True)]
        else:
            fwd += [("all_reduce", exit_, g(row, 0))]
            bwd += [("all_reduce", entry, g(col, 2), True)]
    full = fw.tp_overlap == "full"
    t_fwd = sum(max(0.0, coll(k, b) - (hide if full else 0.0)) for k, b, hide in fwd)
    t_bwd = sum(max(0.0, coll(k, b) - (hide if full or (fw.tp_overlap == "backward" and ok) else 0.0))
                for k, b, hide, ok in bwd)
    seconds = sum(coll(k, b) for k, b, *_ in fwd + bwd)
    if lay.recompute == "full":  # the recomputed forward gathers and reduces again
        seconds += sum(coll(k, b) for k, b, _ in fwd)
    return t_fwd, t_bwd, t_fwd if lay.recompute == "full" else 0.0, seconds


def estimate(arch: Arch, lay: Layout, work: Workload, cluster: ClusterSpec) -> Estimate:
    """Predict memory and step time of ``lay`` (see the module docstring)."""
    m = lay.microbatches(work.global_batch)
    memory = memory_per_gpu(arch, lay, work)

    G, R, s = cluster.gpus_per_node, cluster.matmul_flops, work.seq_len
    fw = work.framework
    sizes = tuple(lay.sizes().items())
    dt = act.dtypes_for(arch, work.precision, fw.activations)
    e, r = dt.act, dt.resid
    tokens = lay.micro_batch * s / lay.cp  # per GPU per micro-batch (samples split over dp x ep)
    per_rank = per_rank_layers(arch, lay)
    gpu = cluster.gpu
    kernels = gpu is not None and work.precision in ("bf16", "fp16")

    # -- per micro-batch, per block: compute (kernels.py; without GPU figures, GEMM FLOPs at R) --------
    gemm: Dict[str, Tuple[float, float, float]] = {}
    # an MoE model's dense blocks (first_dense_blocks, moe_every) are timed as dense blocks
    dense_kind: Tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    eh_f = eh_b = 0.0  # an MTP module's eh_proj (2h -> h), per micro-batch
    if kernels:
        assert gpu is not None

        def kind_cost(a: Arch) -> Tuple[float, float, float, float, float, float, Dict[str, Any]]:
            bc = block_cost(a, fw, gpu, R, tokens, s, lay.tp, lay.sp, lay.cp, e, r, work.fp8)
            f, b, w = bc.fwd, bc.bwd, bc.wgrad
            if work.lora is not None:  # frozen base: no weight-gradient GEMMs; the adapters' skinny products
                ad_f, ad_b = adapter_cost(a, work.lora, gpu, R, tokens, lay.tp, e)
                f, b, w = f + ad_f, b - w + ad_b, 0.0
            return f, b, w, bc.recompute(lay.recompute, fw.selective), bc.attn_fwd, bc.attn_bwd, bc.gemm

        layer_f, layer_b, layer_w, layer_re, attn_f, attn_b, gemm = kind_cost(arch)
        dense_kind = (layer_f, layer_b, layer_w, layer_re)
        if arch.is_moe and arch.n_moe_layers < arch.n_layers + (arch.mtp_depth if not arch.mtp_is_moe else 0):
            dense_kind = kind_cost(dataclasses.replace(arch, num_experts=1, top_k=1, shared_experts=0))[:4]
        head_f, head_b, head_w = head_cost(arch, fw, gpu, R, tokens, lay.tp, lay.sp, e, r)
        emb_f, emb_b = embedding_cost(arch, gpu, tokens, lay.tp, lay.sp, e)
        if arch.mtp_depth:
            eh_f = gemm_time(Gemm(tokens, arch.d_model, 2 * arch.d_model, e=e), gpu, R)
            eh_b = 2 * eh_f if work.lora is None else eh_f
        if work.lora is not None:
            head_b, head_w, emb_b = head_b - head_w, 0.0, 0.0
    else:
        layer_f = tokens * arch.layer_forward_flops_per_token(s) / lay.tp / R
        layer_re = tokens * recompute_flops_per_token(arch, s, lay.recompute) / lay.tp / R
        attn_f = tokens * arch.attention_core_flops_per_token(s) / lay.tp / R
        layer_b, layer_w, attn_b = 2 * layer_f, layer_f, 2 * attn_f
        head_f = tokens * arch.head_forward_flops_per_token() / lay.tp / R
        head_b, head_w, emb_f, emb_b = 2 * head_f, head_f, 0.0, 0.0
        if work.lora is not None:  # no weight gradients for the frozen base
            layer_b, layer_w, head_b, head_w = layer_b - layer_f + attn_f, 0.0, head_f, 0.0
        dense_kind = (layer_f, layer_b, layer_w, layer_re)

    def tp_coll(kind: str, nbytes: float) -> float:
        return _time(cluster, "tp", kind, nbytes, lay.tp, 1)

    tp_f, tp_b, tp_re, tp_seconds = _tp_collectives(lay, fw, tokens, arch.d_model, e, r, gemm, tp_coll)
    # the dispatch moves the residual stream's dtype (hpctrain: fp32), the combine the experts' output
    rows = tokens * arch.top_k * arch.d_model / (lay.tp if lay.sp else 1)
    n_in, n_out = group_span(sizes, ("ep",), G)
    # one dispatch and one combine: t_a2a is their mean, each pass (forward, backward) runs two
    t_a2a = (_time(cluster, "ep", "all_to_all", rows * r, n_in, n_out)
             + _time(cluster, "ep", "all_to_all", rows * e, n_in, n_out)) / 2 if arch.is_moe else 0.0
    kv_bytes = 2 * tokens * arch.kv_dim_per_rank(lay.tp) * e
    n_in, n_out = group_span(sizes, ("cp",), G)
    t_kv = _time(cluster, "cp", "p2p", kv_bytes, 2 if n_out == 1 else 1, 1 if n_out == 1 else 2) * (lay.cp - 1)
    # backward: the blocks again, and their gradient accumulators (hpctrain's: fp32, cp hand-overs; traffic.cp_bytes)
    t_dkv = (_time(cluster, "cp", "p2p", kv_bytes * 4 / e, 2 if n_out == 1 else 1, 1 if n_out == 1 else 2) * lay.cp
             if fw.ours and lay.cp > 1 else t_kv)
    cp_f, cp_b = max(0.0, t_kv - attn_f), max(0.0, t_kv + t_dkv - attn_b)

    # per micro-batch, per parameter on the GPU: casts and gradient accumulation outside the GEMMs
    shards = lay.dp * lay.cp * lay.ep if lay.zero >= 1 else 1

    def params_of(rank: int) -> float:
        dense, expert, _ = stage_params(arch, lay, rank)
        return dense + expert

    param_pass = param_pass_bytes(fw, work.precision, shards) if kernels else 0.0

    def kinds(rank: int) -> Tuple[int, int]:
        """(MoE blocks, dense blocks) on pipeline rank ``rank``, its MTP modules' blocks included."""
        moe = sum(arch.moe_layers_in(b.start, b.stop) for b in rank_blocks(arch, lay, rank))
        dense = per_rank[rank] - moe
        if rank == lay.pp - 1 and arch.mtp_depth:
            moe, dense = (moe + arch.mtp_depth, dense) if arch.mtp_is_moe else (moe, dense + arch.mtp_depth)
        return moe, dense

    def pure(rank: int) -> Tuple[float, float]:
        """(forward, backward incl. recompute) of the rank's blocks and head, without collectives."""
        moe, dense = kinds(rank)
        last = rank == lay.pp - 1
        mtp = arch.mtp_depth if last else 0  # each MTP module: its block, eh_proj and the shared head again
        f = moe * layer_f + dense * dense_kind[0] + (head_f if last else 0.0) + mtp * (head_f + eh_f)
        b = (moe * (layer_b + layer_re) + dense * (dense_kind[1] + dense_kind[3]) + (head_b if last else 0.0)
             + mtp * (head_b + eh_b))
        return f, b

    def stage_times(rank: int, layers: int) -> Tuple[float, float, float]:
        first, last = rank == 0, rank == lay.pp - 1
        moe, dense = kinds(rank)
        blocks = moe + dense
        pf, pb = pure(rank)
        f = pf + blocks * (tp_f + cp_f) + moe * 2 * t_a2a + (emb_f if first else 0.0)
        mtp = arch.mtp_depth if last else 0
        w = moe * layer_w + dense * dense_kind[2] + (1 + mtp) * (head_w if last else 0.0)
        b = pb + blocks * (tp_b + tp_re + cp_b) + moe * 2 * t_a2a + (emb_b if first else 0.0)
        if param_pass and gpu is not None:
            b += pass_time(param_pass * params_of(rank), gpu)
        return f, b, w

    times = [stage_times(rk, n) for rk, n in enumerate(per_rank)]
    slowest = max(range(lay.pp), key=lambda rk: times[rk][0] + times[rk][1])  # it paces the pipeline
    t_f, t_b, t_w = times[slowest]
    slow_moe, slow_dense = kinds(slowest)
    layers = slow_moe + slow_dense
    comm = stage_bytes(arch, lay, work, slowest)
    bubble = stage_bubble_time(lay.schedule, lay.vpp, *(list(t) for t in zip(*times))) if lay.pp > 1 else 0.0
    compute = m * (t_f + t_b)

    # -- pipeline p2p ----------------------------------------------------------
    # the residual stream crosses stages: hpctrain keeps it fp32 under autocast (r), the others 16-bit
    pp_bytes = tokens * arch.d_model * r / (lay.tp if lay.sp else 1)
    n_in, n_out = group_span(sizes, ("pp",), G)
    transfers = 2 * (m * lay.vpp + lay.pp - 1) if lay.pp > 1 else 0
    one_p2p = _time(cluster, "pp", "p2p", pp_bytes, 2 if n_out == 1 else 1, 1 if n_out == 1 else 2)
    # overlapped in the steady state (Megatron-Core's default): only the fill and drain wait
    t_pp = (2 * (lay.pp - 1) if fw.pp_overlap and lay.pp > 1 else transfers) * one_p2p

    # -- data parallel (dense over cp x ep x dp, experts over cp x dp) ----------
    # dp collectives hide behind compute only, not behind the tp/cp/ep
    # collectives inside t_f and t_b (they compete for the same links)
    # (on the slowest stage; the last one's head is counted there if it is the slowest, always without pp)
    pure_f, pure_b = pure(slowest)
    t_dp, wire_dp = _data_parallel(arch, lay, work, cluster, sizes, m, pure_f, pure_b)

    exposed = {"tp": m * layers * (tp_f + tp_b + tp_re), "cp": m * layers * (cp_f + cp_b),
               "ep": m * slow_moe * 4 * t_a2a, "pp": t_pp, "dp": t_dp}
    wire_time = dict(exposed, tp=m * layers * tp_seconds, cp=m * layers * (2 * t_kv + t_dkv), pp=transfers * one_p2p,
                     dp=wire_dp)
    # tp/cp/ep are inside t_f/t_b; report them separately and keep compute pure
    compute -= exposed["tp"] + exposed["cp"] + exposed["ep"]
    optimizer = 0.0
    if kernels and gpu is not None:
        local = max(params_of(rk) for rk in memory_stages(arch, lay))
        if work.lora is not None:  # the optimizer steps the adapters only
            local = max(rank_adapters(arch, lay, work.lora, rk)[0] for rk in memory_stages(arch, lay))
        optimizer = pass_time(optimizer_bytes(fw, local, local / shards), gpu)
    contention = overlap_contention(wire_time, exposed) if kernels else 0.0
    time = StepTime(compute, bubble, exposed, optimizer, contention)
    tokens_step = work.global_batch * s
    step = time.total
    flops = model_flops_per_token(arch, s) if work.lora is None else lora_model_flops_per_token(arch, s)
    mfu = tokens_step * flops / (step * lay.gpus * cluster.peak_flops)
    fits = memory.total <= cluster.mem_bytes
    frac = bubble / (compute + bubble + exposed["tp"] + exposed["cp"] + exposed["ep"]) if bubble else 0.0
    return Estimate(lay, memory, time, fits, m, frac, mfu, tokens_step / step, comm, wire_time)


OVERLAP_SLOWDOWN = 0.189
"""Compute kernels run this much longer while a collective runs beside them: the average slowdown over
GPT and Llama training kernels on A100, H100, MI250 and MI210 (Characterizing Compute-Communication
Overlap in GPU-Accelerated Distributed Deep Learning, arXiv:2507.03114, abstract: "an average
computational slowdown of 18.9%, with a maximum of 40.0%"). The collective's kernels hold SMs and
HBM bandwidth the GEMMs would use."""


def overlap_contention(wire: Dict[str, float], exposed: Dict[str, float]) -> float:
    """Seconds the step loses to communication it hides: while a collective runs for ``c`` seconds
    beside compute slowed by ``OVERLAP_SLOWDOWN``, the compute finishes ``c / (1 + slowdown)`` seconds of
    its work, so the step grows by ``c * slowdown / (1 + slowdown)``. Only the hidden part counts (wire
    minus exposed, per axis): exposed seconds already wait with no compute beside them."""
    hidden = sum(max(0.0, wire.get(axis, 0.0) - exposed.get(axis, 0.0)) for axis in exposed)
    return hidden * OVERLAP_SLOWDOWN / (1.0 + OVERLAP_SLOWDOWN)


def _data_parallel(arch: Arch, lay: Layout, work: Workload, cluster: ClusterSpec,
                   sizes: Tuple[Tuple[str, int], ...], m: int, t_f: float, t_b: float) -> Tuple[float, float]:
    """(exposed seconds, wire seconds) of gradient reduction and ZeRO gathers per step (their bytes:
    ``traffic.dp_bytes``).

    Overlap is per micro-batch: a micro-batch's gathers and reduce-scatters hide
    only behind that micro-batch's forward (``t_f``) and backward (``t_b``),
    never behind the rest of the step, and one bucket of each is always exposed
    (the first gather has nothing before it, the last reduce-scatter nothing
    after it). Stage 1/2's parameter all-gather runs after the optimizer step
    with nothing to hide behind."""
    G = cluster.gpus_per_node
    dense, expert, _ = max(stage_params(arch, lay, r) for r in memory_stages(arch, lay))
    sb = work.state_bytes
    # LoRA: the data axes reduce the adapters only (they sit with the dense weights); ZeRO 3 still gathers every
    # weight
    adapters = (max(rank_adapters(arch, lay, work.lora, rk)[0] for rk in memory_stages(arch, lay))
                if work.lora is not None else 0.0)
    groups: List[Tuple[float, Tuple[str, ...], int]] = [(dense, ("cp", "ep", "dp"), lay.cp * lay.ep * lay.dp)]
    if expert:
        groups.append((expert, ("cp", "dp"), lay.cp * lay.dp))
    exposed = seconds = 0.0
    for params, axes, n in groups:
        if n == 1 or params == 0:
            continue
        n_in, n_out = group_span(sizes, axes, G)

        def t(kind: str, nbytes: float, n_in: int = n_in, n_out: int = n_out) -> float:
            # bucketed: one collective per bucket
            buckets = max(1, int(-(-nbytes // work.bucket_bytes)))
            return buckets * _time(cluster, "dp", kind, nbytes / buckets, n_in, n_out)

        def one(kind: str, nbytes: float, n_in: int = n_in, n_out: int = n_out) -> float:
            # the bucket no compute can hide (first or last)
            return _time(cluster, "dp", kind, min(nbytes, work.bucket_bytes), n_in, n_out)

        fw = work.framework
        # FSDP2 and Megatron's distributed optimizer gather 16-bit parameters; hpctrain its fp32 ones
        grads, weights = params * sb.grads, params * (sb.weights if fw.ours else 2.0)
        if work.lora is not None:
            trained = adapters if axes[-2:] == ("ep", "dp") else 0.0
            grads = trained * sb.grads
            if lay.zero == 3:
                weights += trained * (sb.weights if fw.ours else 2.0)
            else:
                weights = trained * (sb.weights if fw.ours else 2.0)
        hide_b = t_b if fw.dp_overlap else 0.0  # a code that reduces after the last backward hides nothing
        rs_hidden = max(one("reduce_scatter", grads), t("reduce_scatter", grads) - hide_b)
        ag, rs = t("all_gather", weights), t("reduce_scatter", grads)
        # Megatron's --overlap-param-gather: the gather runs behind the next step's first forward
        ag_exposed = max(one("all_gather", weights), ag - t_f) if fw.param_gather_overlap else ag
        if lay.zero == 0:
            exposed += max(one("all_reduce", grads), t("all_reduce", grads) - hide_b)
            seconds += t("all_reduce", grads)
        elif lay.zero == 1 or (lay.zero == 2 and lay.pp > 1):  # ZeRO-2 under a pipeline: one reduce-scatter per step
            exposed += rs_hidden + ag_exposed
            seconds += rs + ag
        elif lay.zero == 2:
            exposed += m * rs_hidden + ag
            seconds += m * rs + ag
        elif lay.pp > 1:  # forward and backward gathers every micro-batch, the reduce-scatter in the last backward
            # (the plugin skips the backward gather of the stage's last block, kept gathered: a slight over-count)
            exposed += m * max(one("all_gather", weights), ag - t_f)
            exposed += (m - 1) * max(one("all_gather", weights), ag - t_b)
            exposed += max(one("reduce_scatter", grads), ag + rs - t_b)
            seconds += m * 2 * ag + rs
        else:  # forward gather, backward gather + reduce-scatter, every micro-batch
            exposed += m * (max(one("all_gather", weights), ag - t_f)
                            + max(one("reduce_scatter", grads), ag + rs - t_b))
            seconds += m * (2 * ag + rs)
    return exposed, seconds
