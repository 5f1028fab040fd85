"""How a training code executes a transformer: the planner's second input besides the model.

The same model and layout run at different speeds and in different memory
under different codes: one fuses its pointwise kernels and another runs them
op by op, one overlaps its tensor-parallel collectives with the GEMMs and
another waits for them, one keeps fp32 weights and another bf16 ones. A
``Framework`` names those choices; the compute model (``kernels``), the
memory model (``memory``, ``activations``) and the step model (``estimate``)
read them. ``hpctrain-plan`` plans for hpctrain's own code (``hpctrain``,
or ``hpctrain-compiled`` with ``trainer.compile=true``); ``--validate`` plans each
published run with the code that ran it (``published_runs.yaml``'s
``framework``), so the comparison is of the model, not of two codes.

Each entry says where it was read (the source at the version the published
runs used); docs/planner.md ("Frameworks") lists the same facts.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, Optional, Tuple

from hpctrain.planner.memory import HPCTRAIN, StateBytes

ALL_SCHEDULES = ("1f1b", "interleaved", "zb-h1")
ALL_RECOMPUTE = ("none", "selective", "full")

# Model states (bytes per parameter: weights, gradients, optimizer incl. fp32 masters)
MEGATRON_FP16 = StateBytes(2, 2, 12, 0.0, "Megatron-LM fp16: fp16 weights and gradients, fp32 masters + Adam "
                                          "moments (ZeRO paper's 16 bytes)")
MEGATRON_DISTOPT = StateBytes(2, 4, 12, 0.0, "Megatron distributed optimizer: bf16 weights, fp32 main gradients, "
                                             "fp32 masters + Adam moments sharded")
FSDP2_MP = StateBytes(4, 4, 8, 0.0, "FSDP2 mixed precision: fp32 sharded weights (bf16 gathered), fp32 sharded "
                                    "gradients, Adam moments")


@dataclass(frozen=True)
class Framework:
    """What a training code does, as far as time and memory are concerned."""

    key: str
    label: str
    attention: str
    """``flash`` (fused kernel, no s x s matrix) or ``unfused`` (QK^T and AV batched GEMMs with the
    softmax and dropout as separate memory-bound kernels over s x s scores)."""
    attention_kernel: str
    """``fa2`` or ``fa3`` (``hardware.GpuKind.attention``); unused when unfused."""
    pointwise: str
    """``fused`` (one kernel per pointwise region), ``eager`` (torch op by op, hpctrain's model),
    ``torchtitan-eager`` (torchtitan's model op by op)."""
    tp_overlap: str
    """``none`` (every tensor-parallel collective waits), ``backward`` (Megatron-LM 2022: the column-parallel
    input-gradient reduction overlaps the weight-gradient GEMM, the sequence re-gather the input-gradient
    GEMM), ``full`` (each collective pipelined with its GEMM: TE userbuffers, torch async TP)."""
    dp_overlap: bool
    """Gradient reduction overlapped with the backward (else it follows the last backward, exposed)."""
    param_gather_overlap: bool
    """ZeRO-1/2's parameter all-gather overlapped with the next forward (Megatron --overlap-param-gather)."""
    pp_overlap: bool
    """Pipeline sends/receives overlapped with compute in the steady state."""
    grad_accum_fusion: bool
    """The weight-gradient GEMM accumulates into the fp32 main gradient (no pass per micro-batch)."""
    states: StateBytes
    activations: str
    """``hpctrain`` (the measured table of our block), ``megatron`` (Korthikanti's table, 16-bit) or
    ``torchtitan`` (bf16, per-op selective checkpointing as torchtitan defines it)."""
    dropout: bool
    """Hidden and attention dropout on (Megatron's GPT default 0.1): masks are written and kept."""
    optimizer: str
    """``fused-adam`` (apex/TE multi-tensor Adam, one pass), ``foreach-adam`` (torch's foreach AdamW)."""
    schedules: Tuple[str, ...] = ALL_SCHEDULES
    recompute: Tuple[str, ...] = ALL_RECOMPUTE
    zero: Tuple[int, ...] = (0, 1, 2, 3)
    """The ZeRO stages the code has (Megatron-LM before its distributed optimizer: 0; FSDP: 3)."""
    even_chunks: bool = False
    """Interleaving needs the blocks to divide evenly into pp x vpp chunks (Megatron's rule)."""
    selective: str = "attention"
    """What ``recompute=selective`` recomputes: ``attention`` (the core, Korthikanti et al.) or ``op``
    (torchtitan's per-op policy: every second matmul and every pointwise op)."""
    source: str = ""

    @property
    def ours(self) -> bool:
        return self.key.startswith("hpctrain")


HPCTRAIN_FW = Framework(
    "hpctrain", "hpctrain (eager)", "flash", "fa2", "eager", "none", True, False, False, False, HPCTRAIN,
    "hpctrain", False, "foreach-adam",
    source="this repository: hpctrain/model/transformer.py (eager RMSNorm, RoPE, SwiGLU; torch SDPA), "
           "plugins/hpctrain_tp (collectives inside autograd functions, waited on), hpctrain/optimizers/adamw.py "
           "(torch AdamW, foreach)")
HPCTRAIN_COMPILED = replace(HPCTRAIN_FW, key="hpctrain-compiled", label="hpctrain (trainer.compile)",
                            pointwise="fused")

FRAMEWORKS: Dict[str, Framework] = {f.key: f for f in (
    HPCTRAIN_FW, HPCTRAIN_COMPILED,
    Framework("megatron-lm-2021", "Megatron-LM (April 2021)", "unfused", "fa2", "fused", "none", False, False,
              False, False, MEGATRON_FP16, "megatron", True, "fused-adam", ("1f1b", "interleaved"), ("full",),
              source="NVIDIA/Megatron-LM 50a4b5fa02: megatron/model/transformer.py (baddbmm/bmm attention, "
                     "FusedScaleMaskSoftmax, attention dropout, bias_gelu and bias_dropout_add fusions), "
                     "megatron/training.py (allreduce_gradients after the backward), local DDP fp16 .grad"),
    Framework("megatron-lm-2022", "Megatron-LM (mid 2022)", "unfused", "fa2", "fused", "backward", False, False,
              False, False, MEGATRON_FP16, "megatron", True, "fused-adam", ("1f1b", "interleaved"),
              source="NVIDIA/Megatron-LM 55ba1f7b96: megatron/mpu/layers.py "
                     "LinearWithGradAccumulationAndAsyncCommunication (async input-gradient all-reduce / "
                     "reduce-scatter and sequence re-gather overlapped with GEMMs; its fused fp32 weight-gradient "
                     "accumulation needs fp32 accumulation, which fp16 runs do not turn on: "
                     "megatron/arguments.py), selective recompute of the attention core"),
    Framework("megatron-deepspeed-2022", "Megatron-DeepSpeed (BLOOM, 2022)", "unfused", "fa2", "fused", "none",
              False, False, False, False, MEGATRON_DISTOPT, "megatron", False, "fused-adam", ("1f1b",),
              ("full",),
              source="bigscience-workshop/Megatron-DeepSpeed (a 2021 Megatron-LM fork: same fused kernels, "
                     "unfused attention); DeepSpeed pipeline engine (1F1B), BF16_Optimizer with ZeRO-1 reducing "
                     "after the pipeline flush; tr11 dropout 0"),
    Framework("megatron-core-2024", "Megatron-Core r0.8 (Transformer Engine)", "flash", "fa3", "fused", "full",
              True, True, True, True, MEGATRON_DISTOPT, "megatron", True, "fused-adam", ("1f1b", "interleaved"),
              source="NVIDIA/Megatron-LM f2e5db402c README: --overlap-grad-reduce --overlap-param-gather "
                     "--tp-comm-overlap, pipeline communication overlapped by default; TE fused attention "
                     "(cuDNN), distributed optimizer, Megatron's GPT dropout defaults"),
    Framework("nemo-2024", "NeMo / Megatron-Core (Transformer Engine)", "flash", "fa3", "fused", "full", True,
              True, True, True, MEGATRON_DISTOPT, "megatron", False, "fused-adam", ("1f1b", "interleaved"),
              source="NeMo Nemotron-4 recipes on Megatron-Core: TE fused attention, tp communication overlap, "
                     "distributed optimizer with overlapped reduce/gather; Nemotron-4 has no dropout"),
    Framework("llama3-2024", "Meta's Llama 3 training stack (as far as published)", "flash", "fa2", "fused",
              "none", True, False, True, True, MEGATRON_DISTOPT, "megatron", False, "fused-adam",
              ("1f1b", "interleaved"),
              source="Llama 3 paper section 3.3.2 (4D parallelism, FSDP-style sharding of the optimizer, "
                     "interleaved 1F1B); kernels and saved tensors not published: fused pointwise kernels, "
                     "FlashAttention-2 (the public kernel when the run trained) and Megatron's sequence-parallel "
                     "activations assumed"),
    Framework("torchtitan-eager", "torchtitan (eager)", "flash", "fa2", "torchtitan-eager", "none", True, False,
              False, True, FSDP2_MP, "torchtitan", False, "foreach-adam", ("1f1b", "interleaved"),
              selective="op",
              source="pytorch/torchtitan 9dec370: torchtitan/models/llama/model.py (RMSNorm and complex RoPE in "
                     "torch ops), parallelize_llama.py (FSDP2 bf16 param / fp32 reduce, per-op SAC policy), "
                     "torch SDPA (FlashAttention-2), foreach AdamW"),
    Framework("torchtitan-compiled", "torchtitan (torch.compile)", "flash", "fa2", "fused", "none", True, False,
              False, True, FSDP2_MP, "torchtitan", False, "foreach-adam", ("1f1b", "interleaved"),
              selective="op", source="as torchtitan-eager, each block compiled (inductor fuses the pointwise ops)"),
)}
# the ZeRO stages and interleaving rule of each code (transcribed with the sources above)
for _key, _zero, _even in (("megatron-lm-2021", (0,), True), ("megatron-lm-2022", (0,), True),
                           ("megatron-deepspeed-2022", (1,), False), ("megatron-core-2024", (0, 1), True),
                           ("nemo-2024", (0, 1), True), ("llama3-2024", (1, 2, 3), False),
                           ("torchtitan-eager", (3,), False), ("torchtitan-compiled", (3,), False)):
    FRAMEWORKS[_key] = replace(FRAMEWORKS[_key], zero=_zero, even_chunks=_even)
FRAMEWORKS["torchtitan-compiled-asynctp"] = replace(
    FRAMEWORKS["torchtitan-compiled"], key="torchtitan-compiled-asynctp", label="torchtitan (compile, async TP)",
    tp_overlap="full", source="torchtitan --parallelism.enable_async_tensor_parallel (micro-pipelined TP)")


def framework(key: str) -> Framework:
    """The framework named ``key``; ValueError listing the known ones."""
    if key not in FRAMEWORKS:
        raise ValueError(f"unknown framework {key!r}; known: {', '.join(sorted(FRAMEWORKS))}")
    return FRAMEWORKS[key]


def for_config(cfg: Optional[object]) -> Framework:
    """hpctrain's own code as ``cfg`` runs it (``trainer.compile`` fuses the pointwise ops)."""
    trainer = getattr(cfg, "trainer", None)
    return HPCTRAIN_COMPILED if bool(getattr(trainer, "compile", False)) else HPCTRAIN_FW
