"""Llama-style decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention; as
options of the same forward, Qwen2's q/k/v biases and Qwen3's qk-norm
(``Attention``) and a head size other than d_model / n_heads.

Multi-head latent attention (DeepSeek-V2/V3, ``model.attention_kind=mla``) is
another attention sub-layer with the same forward signature and seams,
``hpctrain.model.mla.MLAttention``, which ``Block`` takes in place of
``Attention``; the rotary tables then cover its decoupled rotary part
(``ModelShape.rope_dim``), with yarn's scaling (``hpctrain.model.yarn``).

Replaceable parts: ``block.attn.core`` (core attention), ``block.ffn`` (the
feed-forward block: SwiGLU here, MoE from a plugin) and ``model.loss_fn``
(vocab-parallel cross-entropy from the TP plugin).

Seams, where an axis changes how a part computes without replacing the
block's forward (so recomputation, MoE and context parallelism keep
working under every axis):

- ``Attention.linears`` and ``SwiGLU.linears`` (``Linears``): how the input
  projections (Q/K/V with their biases, if any; gate/up) and the output
  projection compute. Tensor parallelism puts its column/row-parallel region
  here;
- ``RMSNorm.weight_view``: the weight as forward uses it (sequence
  parallelism routes it through a collective that sums its gradient; so
  does tensor parallelism for qk-norm, each rank normalising its own heads).

Head counts are derived from the projection outputs at run time, so a
plugin that narrows ``wq``/``wk``/``wv`` to a rank's heads, or gathers the
sequence, needs no change here.

Document masking (``forward(..., segments=)``): ``segments`` gives each
token the index of its document in its sample, shaped like the token ids
(the tokens this rank holds, as ``positions``); every block's attention
core receives it and lets a query attend only to earlier keys of its own
document. RoPE takes ``positions`` as given (with document masking, each
token's position within its document). Under sequence parallelism the
attention core sees the gathered sequence, which is what ``segments``
covers, so it needs no splitting.

Each module lists the initialisation of its parameters in ``param_init``
(default ``normal``); the builder turns that into the parameter's ShardSpec.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union, cast

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.finetune.adapter import adapted
from hpctrain.model.mtp import MTP
from hpctrain.model.recompute import recomputed
from hpctrain.model.shapes import ModelShape
from hpctrain.model.yarn import YarnScaling


def _same(weight: torch.Tensor) -> torch.Tensor:
    return weight


class Linears:
    """How a sub-layer's projections compute (one process: each ``nn.Linear`` called).

    ``columns(x, linears)`` projects the sub-layer input ``x`` by each of
    ``linears`` (Q/K/V, or gate/up), its bias added when it has one
    (``model.qkv_bias``); ``rows(y, linear)`` projects back to
    the hidden size (the output projection). Tensor parallelism replaces this
    object with one that enters and leaves its region. The one-process
    version calls the modules, so whatever wraps or hooks them (torch's own
    tensor parallelism in the benchmark) still applies, and a projection's LoRA adapter
    (``hpctrain.finetune.adapter``) adds its update."""

    def columns(self, x: torch.Tensor, linears: Sequence[nn.Linear]) -> List[torch.Tensor]:
        return [adapted(linear, x) for linear in linears]

    def rows(self, y: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
        return adapted(linear, y)


LOCAL = Linears()


class RMSNorm(nn.Module):
    param_init = {"weight": "ones"}

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.weight_view: Callable[[torch.Tensor], torch.Tensor] = _same
        """The seam for the weight as forward uses it (sequence parallelism: summed over tp in backward)."""

    def scale(self) -> torch.Tensor:
        """The weight as forward uses it."""
        return self.weight_view(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.scale().float()).type_as(x)


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's RoPE frequency scaling (``model.rope_scaling`` with type llama3)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_seq_len: int

    @classmethod
    def from_config(cls, rs: Any) -> Optional[Union["RopeScaling", YarnScaling]]:
        """The scaling ``model.rope_scaling`` names: llama3 (this class), yarn (``YarnScaling``) or None."""
        if rs is None or rs.type is None:
            return None
        if rs.type == "yarn":
            return YarnScaling.from_config(rs)
        if rs.type != "llama3":
            raise ValueError(f"model.rope_scaling.type={rs.type!r}: only llama3, yarn (or null) are implemented")
        return cls(float(rs.factor), float(rs.low_freq_factor), float(rs.high_freq_factor),
                   int(rs.original_max_seq_len))


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[RopeScaling] = None,
                  device: Optional[torch.device] = None) -> torch.Tensor:
    """(head_dim/2,) fp32 inverse frequencies; with ``scaling``, Llama 3.1's rule: wavelengths longer than
    original / low_freq_factor are stretched by ``factor``, those shorter than original / high_freq_factor
    kept, and the band between interpolated linearly in original / wavelength (the same arithmetic, in the
    same order, as transformers' llama3 RoPE, so the frequencies agree to the bit)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling is None:
        return inv_freq
    old = scaling.original_max_seq_len
    low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    stretched = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * stretched / scaling.factor + smooth * stretched
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, stretched)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float,
                scaling: Optional[Union[RopeScaling, YarnScaling]] = None):
    """cos, sin for the given positions: (seq, head_dim/2) for positions (seq,)
    shared by the batch, (batch, seq, head_dim/2) for per-sample positions
    (batch, seq) (document masking: positions within each document). Under
    yarn both are multiplied by its attention factor, as transformers does."""
    if isinstance(scaling, YarnScaling):
        inv_freq = scaling.inv_freq(head_dim, theta, positions.device)
    else:
        inv_freq = rope_inv_freq(head_dim, theta, scaling, positions.device)
    angles = positions.float()[..., None] * inv_freq
    if isinstance(scaling, YarnScaling) and scaling.attention_factor != 1.0:
        return angles.cos() * scaling.attention_factor, angles.sin() * scaling.attention_factor
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, seq, heads, head_dim); rotates interleaved pairs (Llama convention).
    cos, sin: (seq, head_dim/2), or (batch, seq, head_dim/2) per sample."""
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    if cos.dim() == 2:
        c, s = cos[None, :, None, :], sin[None, :, None, :]
    else:
        c, s = cos[:, :, None, :], sin[:, :, None, :]
    out = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    return out.type_as(x)


class Attention(nn.Module):
    """Grouped-query attention. Options of the shape (``ModelShape``): ``qkv_bias``, biases on ``wq``, ``wk``
    and ``wv`` (Qwen2; ``wo`` has none), initialised to zero; ``qk_norm``, an RMSNorm over each query and key
    head (``q_norm``, ``k_norm``: one weight of size head_dim each, shared by the heads), applied before RoPE
    (Qwen3). Both go through the seams: the biases are the projections' own (``Linears``), the norms'
    weights pass ``RMSNorm.weight_view``."""

    param_init: Dict[str, str] = {}

    def __init__(self, shape: ModelShape, core: nn.Module, eps: float = 1e-5):
        super().__init__()
        self.head_dim = shape.head_dim
        bias = shape.qkv_bias
        self.wq = nn.Linear(shape.d_model, shape.q_dim, bias=bias)
        self.wk = nn.Linear(shape.d_model, shape.kv_dim, bias=bias)
        self.wv = nn.Linear(shape.d_model, shape.kv_dim, bias=bias)
        self.wo = nn.Linear(shape.q_dim, shape.d_model, bias=False)
        # (cast: torch types Module.__setattr__ for tensors and modules only)
        cast(Any, self.wo).param_init = {"weight": "normal_scaled"}
        if bias:
            for linear in (self.wq, self.wk, self.wv):
                cast(Any, linear).param_init = {"bias": "zeros"}
        self.q_norm: Optional[RMSNorm] = RMSNorm(shape.head_dim, eps) if shape.qk_norm else None
        """qk-norm of the query heads (None: none)."""
        self.k_norm: Optional[RMSNorm] = RMSNorm(shape.head_dim, eps) if shape.qk_norm else None
        """qk-norm of the key heads (None: none)."""
        self.core = core
        self.linears: Linears = LOCAL
        """The projections' seam (see ``Linears``)."""
        self.recompute_core = False
        """Selective recomputation: the core keeps only q, k, v for backward."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segments: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``segments`` (batch, seq): document masking's per-token document
        index, handed to the core (which is called with q, k, v alone when None)."""
        q, k, v = self.linears.columns(x, [self.wq, self.wk, self.wv])
        b, t = q.shape[:2]  # t: the tokens the projections produced (sequence parallelism gathers them)
        q, k = q.view(b, t, -1, self.head_dim), k.view(b, t, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = v.view(b, t, -1, self.head_dim)
        args: Tuple[torch.Tensor, ...] = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        if segments is not None:
            args += (segments,)  # recomputation keeps it with q, k, v (an integer tensor: no gradient)
        out = recomputed(self.core, *args) if self.recompute_core else self.core(*args)
        return self.linears.rows(out.transpose(1, 2).reshape(b, t, -1), self.wo)


class SwiGLU(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.w1 = nn.Linear(shape.d_model, shape.ffn_hidden, bias=False)  # gate
        self.w3 = nn.Linear(shape.d_model, shape.ffn_hidden, bias=False)  # up
        self.w2 = nn.Linear(shape.ffn_hidden, shape.d_model, bias=False)  # down
        cast(Any, self.w2).param_init = {"weight": "normal_scaled"}  # (as for wo)
        self.linears: Linears = LOCAL
        """The projections' seam (see ``Linears``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.linears.columns(x, [self.w1, self.w3])
        return self.linears.rows(F.silu(gate) * up, self.w2)


class Block(nn.Module):
    def __init__(self, shape: ModelShape, eps: float, attention_core: nn.Module, ffn: nn.Module,
                 attention: Optional[nn.Module] = None):
        """``attention``: the attention sub-layer when it is not ``Attention`` (latent attention,
        ``hpctrain.model.mla``: the same forward signature and seams, built around ``attention_core``)."""
        super().__init__()
        self.attn_norm = RMSNorm(shape.d_model, eps)
        self.attn = attention if attention is not None else Attention(shape, attention_core, eps)
        self.ffn_norm = RMSNorm(shape.d_model, eps)
        self.ffn = ffn
        self.recompute = False
        """Full recomputation: the block keeps only its inputs for backward."""
        self.compiled_forward: Optional[Callable[..., torch.Tensor]] = None
        """``_forward`` compiled (``trainer.compile``, ``hpctrain.model.compile``); None: eager."""

    def forward(self, x, cos, sin, segments=None):
        body = self._forward if self.compiled_forward is None else self.compiled_forward
        if self.recompute:  # checkpoint outside, compiled region inside: recomputation replays the compiled graph
            return recomputed(body, x, cos, sin, segments)
        return body(x, cos, sin, segments)

    def _forward(self, x, cos, sin, segments=None):
        h = self.attn_norm(x)
        # without segments the attention is called with its three inputs, as module hooks that list them expect
        # (torch's PrepareModuleInput in the tensor-parallel peer of hpctrain-bench tp)
        x = x + (self.attn(h, cos, sin) if segments is None else self.attn(h, cos, sin, segments))
        return x + self.ffn(self.ffn_norm(x))


class CrossEntropy(nn.Module):
    """Mean token cross-entropy in fp32 (replaced by a vocab-parallel version under TP) over the targets
    that count: a negative target (a loss mask's 0, ``hpctrain.data.cursor.MASKED``) adds neither loss
    nor count, and a micro-batch with none gives 0 (not 0/0)."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        targets = targets.flatten()
        total = F.cross_entropy(logits.float().flatten(0, -2), targets, ignore_index=-100, reduction="sum")
        return total / (targets >= 0).sum().clamp(min=1)


class Layers(nn.ModuleDict):
    """The blocks, keyed by their index in the whole model (``"0"``, ``"1"``,
    ...), so parameter names are the one-process names even when a pipeline
    stage holds only some blocks. ``layers[3]`` and ``layers["3"]`` are the
    same, and iterating gives the blocks (as a ModuleList would), in order."""

    def __iter__(self):
        return iter(self._modules.values())

    def __getitem__(self, key) -> nn.Module:
        return super().__getitem__(str(key))

    def __delitem__(self, key) -> None:
        super().__delitem__(str(key))

    def __contains__(self, key) -> bool:
        return super().__contains__(str(key))


class Transformer(nn.Module):
    """The decoder, or the part of it one pipeline stage runs (``part``):
    the first stage holds the token embedding, the last the final norm, the
    output projection and the loss; modules a stage does not hold are None
    or absent from ``layers``. With multi-token prediction (``mtp``,
    ``hpctrain.model.mtp``) the last stage holds its modules too, and the
    embedding they share (``mtp_embeddings``, when that stage is not the
    first)."""

    def __init__(self, shape: ModelShape, eps: float, rope_theta: float, blocks,
                 rope_scaling: Optional[Union[RopeScaling, YarnScaling]] = None, mtp: Optional[MTP] = None):
        super().__init__()
        self.shape = shape
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        # (the embedding, head and loss are seams: tensor parallelism puts its own modules there)
        self.tok_embeddings: Optional[nn.Module] = nn.Embedding(shape.vocab_size, shape.d_model)
        self.layers = Layers({str(i): b for i, b in enumerate(blocks)})
        self.norm: Optional[RMSNorm] = RMSNorm(shape.d_model, eps)
        self.output: Optional[nn.Module] = nn.Linear(shape.d_model, shape.vocab_size, bias=False)
        if shape.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.loss_fn: Optional[nn.Module] = CrossEntropy()
        self.mtp: Optional[MTP] = mtp
        """Multi-token prediction's modules (``model.mtp_depth``), beside the head; None: none."""
        self.mtp_embeddings: Optional[nn.Module] = None
        """The embedding ``mtp`` shares, on a last pipeline stage that is not the first (else ``tok_embeddings``)."""

    def part(self, layer_ids: Iterable[int], first: bool, last: bool) -> "Transformer":
        """A new Transformer holding *this* model's modules for one pipeline
        stage (the blocks in ``layer_ids``, the embedding when ``first``, the
        final norm, output projection and loss when ``last``), sharing them
        rather than copying:
        a rank with several interleaved stages takes several parts of one model."""
        out = Transformer.__new__(Transformer)
        nn.Module.__init__(out)
        out.shape, out.rope_theta, out.rope_scaling = self.shape, self.rope_theta, self.rope_scaling
        out.tok_embeddings = self.tok_embeddings if first else None
        out.layers = Layers({str(i): self.layers[i] for i in layer_ids})
        out.norm, out.output, out.loss_fn = (self.norm, self.output, self.loss_fn) if last else (None, None, None)
        out.mtp = self.mtp if last else None
        out.mtp_embeddings = self.tok_embeddings if last and not first and self.mtp is not None else None
        return out

    def forward(
        self,
        inputs: torch.Tensor,
        targets: Optional[torch.Tensor] = None,
        positions: Optional[torch.Tensor] = None,
        segments: Optional[torch.Tensor] = None,
        tokens: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Run the parts this module holds.

        ``inputs``: token ids (batch, seq) when it holds the embedding, else
        hidden states (batch, seq, d_model) from the previous stage. Returns
        logits (batch, seq, vocab), or the mean loss when ``targets`` is
        given, when it holds the head; hidden states otherwise.
        ``positions`` are the tokens' positions for RoPE, (seq,) or
        (batch, seq): their absolute positions (context parallelism passes
        its chunks'), or with document masking their positions within their
        own documents; default ``arange(seq)``. ``segments`` (batch, seq),
        document masking: each token's document index in its sample (the
        same tokens as ``positions``, the whole sequence of this rank even
        when a later stage's input is a sequence-parallel shard); every
        block's attention then stays inside each document. None: one
        sequence per sample. ``tokens``: the token ids (batch, seq), which
        multi-token prediction embeds on a last stage that receives hidden
        states (default ``inputs``); its loss joins the objective through the
        auxiliary-loss channel (``hpctrain.model.mtp``), the returned loss
        stays the language model's.
        """
        if positions is None:
            positions = torch.arange(inputs.shape[1], device=inputs.device)
        cos, sin = rope_tables(positions, self.shape.rope_dim, self.rope_theta, self.rope_scaling)
        x = self.tok_embeddings(inputs) if self.tok_embeddings is not None else inputs
        for block in self.layers.values():
            x = block(x, cos, sin, segments)
        if self.output is None:
            return x
        assert self.norm is not None and self.loss_fn is not None  # set with the head
        h = self.norm(x)
        logits = self.output(h)
        if targets is None:
            return logits
        loss = self.loss_fn(logits, targets)
        if self.mtp is not None:
            embed = self.tok_embeddings if self.tok_embeddings is not None else self.mtp_embeddings
            ids = tokens if tokens is not None else inputs
            if embed is None or ids.dim() != 2:
                raise ValueError("multi-token prediction needs the embedding and the token ids (tokens=) on the "
                                 "stage with the head")
            self.mtp(h, ids, targets, embed, self.output, self.loss_fn, cos, sin, segments)
        return loss
