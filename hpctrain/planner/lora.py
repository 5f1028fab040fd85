"""LoRA in the planner (``finetune=lora``): what the adapters add and what the frozen base no longer needs.

The code it plans is ``hpctrain.finetune`` with the tensor-parallel seam of ``plugins/hpctrain_tp/layers.py``:

- **Adapters per block** (``adapter_params``): on each targeted projection A (r x in) and B (out x r).
  Under tensor parallelism a column-parallel projection (q, k, v, gate, up) cuts B by rows and keeps A
  whole; a row-parallel one (o, down) cuts A by columns and keeps B whole. gate/up/down adapt only dense
  SwiGLU blocks (MoE experts are not adapted). Multi-head latent attention's projections are not planned
  (``LoraPlan.check`` refuses them).
- **Memory**: the base keeps its weights only (no gradient, no optimizer state). ZeRO 1-2 leave frozen
  weights whole; ZeRO 3 shards them like the rest (gathered for forward and backward, never reduced).
  The adapters are trained parameters: ``memory.model_states`` over the same data ranks as the dense
  weights.
- **Communication**: the data axes reduce (and ZeRO 1-2 gather) only the adapters; ZeRO 3 still gathers
  every frozen weight for forward and backward. Tensor parallelism sums the gradient of each whole
  (replicated) A or B over tp every micro-batch (``copy_to_region``'s backward), and no longer sums the
  frozen norms' weight gradients; on the first stage nothing flows back into the frozen embedding, so
  its backward collective and the first block's input-gradient collective are gone.
- **Time**: the base's weight-gradient GEMMs are skipped (about a third of a block's matmul work); each
  adapter adds two skinny GEMMs forward and four backward, timed like every GEMM (mostly by their bytes).
  Model FLOPs per token are 4N + 12lhs: forward and input gradients, no weight gradients.

A masked loss (chat data, ``hpctrain-prepare --format chat``) costs what an unmasked one does: every
position's logits and loss are computed and then masked; the mask is one byte per token, under the
planner's 3% activation tolerance.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from hpctrain.errors import ConfigError
from hpctrain.planner.arch import Arch
from hpctrain.planner.layouts import Layout
from hpctrain.planner.stages import rank_blocks

COLUMN_TARGETS = ("q", "k", "v", "gate", "up")
"""Column-parallel projections (output features cut over tp): the adapter's B is cut, A whole."""
ROW_TARGETS = ("o", "down")
"""Row-parallel projections (input features cut over tp): the adapter's A is cut, B whole."""
FFN_TARGETS = ("gate", "up", "down")


@dataclass(frozen=True)
class LoraPlan:
    """The adapters a LoRA run trains (``finetune.lora``)."""

    rank: int
    targets: Tuple[str, ...]

    def check(self, arch: Arch) -> None:
        """Refuse what the planner cannot count (one line, as every planner refusal)."""
        shape = arch.shape
        if shape is not None and getattr(shape, "mla", None) is not None and set(self.targets) - set(FFN_TARGETS):
            raise ConfigError("the planner does not plan LoRA adapters on multi-head latent attention yet: "
                              "give finetune.lora.targets only gate,up,down, or plan without finetune=lora")


def lora_plan(cfg: Any) -> Optional[LoraPlan]:
    """The run's adapters, or None when it trains every weight."""
    finetune = cfg.get("finetune") if hasattr(cfg, "get") else getattr(cfg, "finetune", None)
    if finetune is None or finetune.get("method", "full") != "lora":
        return None
    return LoraPlan(int(finetune.lora.rank), tuple(str(t) for t in finetune.lora.targets))


def _projections(arch: Arch, moe_block: bool) -> List[Tuple[str, int, int]]:
    """(target, input features, output features) of a block's adaptable projections (whole, before tp)."""
    h = arch.d_model
    q = arch.shape.q_dim if arch.shape is not None and arch.family == "llama" else arch.n_heads * arch.head_dim
    out = [("q", h, q), ("k", h, arch.kv_dim), ("v", h, arch.kv_dim), ("o", q, h)]
    if not moe_block:
        out += [("gate", h, arch.ffn_hidden), ("up", h, arch.ffn_hidden), ("down", arch.ffn_hidden, h)]
    return out


def adapter_params(arch: Arch, lora: LoraPlan, tp: int, moe_block: bool) -> Tuple[float, float, int]:
    """(adapter parameters on one tp rank, of them the whole A/B that tp replicates, tensors) of one block."""
    params = replicated = 0.0
    tensors = 0
    for target, n_in, n_out in _projections(arch, moe_block):
        if target not in lora.targets:
            continue
        if target in COLUMN_TARGETS:  # A whole (r x in), B cut by rows (out/tp x r)
            whole, cut = lora.rank * n_in, n_out // tp * lora.rank
        else:  # A cut by columns (r x in/tp), B whole (out x r)
            whole, cut = n_out * lora.rank, lora.rank * (n_in // tp)
        params += whole + cut
        replicated += whole if tp > 1 else 0.0
        tensors += 2
    return params, replicated, tensors


def stage_adapters(arch: Arch, tp: int, layers: int, moe: int, lora: LoraPlan) -> Tuple[float, float, int]:
    """(adapter parameters, of them tp-replicated, tensors) on one GPU of a stage of ``layers`` blocks,
    ``moe`` of them MoE."""
    dense_p, dense_r, dense_t = adapter_params(arch, lora, tp, moe_block=False)
    moe_p, moe_r, moe_t = adapter_params(arch, lora, tp, moe_block=True)
    dense = layers - moe
    return dense * dense_p + moe * moe_p, dense * dense_r + moe * moe_r, dense * dense_t + moe * moe_t


def rank_adapters(arch: Arch, lay: Layout, lora: LoraPlan, rank: int) -> Tuple[float, float, int]:
    """``stage_adapters`` of pipeline rank ``rank`` of ``lay`` (its blocks, MoE ones counted apart)."""
    blocks = rank_blocks(arch, lay, rank)
    return stage_adapters(arch, lay.tp, sum(len(b) for b in blocks),
                          sum(arch.moe_layers_in(b.start, b.stop) for b in blocks), lora)


def adapter_gemms(arch: Arch, lora: LoraPlan, tp: int, moe_block: bool) -> List[Tuple[float, float]]:
    """(input features, output features) on one tp rank of each adapter's down (A) and up (B) product,
    for ``kernels``' GEMM timing: down maps in -> r, up maps r -> out."""
    out: List[Tuple[float, float]] = []
    for target, n_in, n_out in _projections(arch, moe_block):
        if target not in lora.targets:
            continue
        local_in = n_in if target in COLUMN_TARGETS else n_in // tp
        local_out = n_out // tp if target in COLUMN_TARGETS else n_out
        out += [(local_in, lora.rank), (lora.rank, local_out)]
    return out
