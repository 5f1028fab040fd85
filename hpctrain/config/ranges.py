"""The range of every number a user can type, checked before anything else.

One table (``RULES``): each core key with what its value must be. A value
outside its range is one ``hpctrain: error:`` line naming the key, the
value, the requirement and, where there is one, the fix, raised before any
collective (``validate`` runs these first and stops there when any fails,
since later checks would divide by a zero or a negative size). NaN and
infinities fail every float rule. Plugins check their own sections in
``hpctrain_validate``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, List, Tuple

from omegaconf import OmegaConf

from hpctrain.config.schema import FAULTS, FINETUNE_METHODS, LORA_TARGETS
from hpctrain.mesh import AXES


def _real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def at_least(lo: float) -> Callable[[Any], bool]:
    return lambda x: _real(x) and x >= lo


def above(lo: float) -> Callable[[Any], bool]:
    return lambda x: _real(x) and x > lo


def within(lo: float, hi: float, hi_open: bool = False) -> Callable[[Any], bool]:
    return lambda x: _real(x) and lo <= x and (x < hi if hi_open else x <= hi)


def optional(rule: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda x: x is None or rule(x)


@dataclass(frozen=True)
class Rule:
    key: str
    ok: Callable[[Any], bool]
    need: str
    """What the value must be, as the message says it."""
    fix: str = ""
    """A hint after the requirement (the usual value, the way to turn a feature off)."""


RULES: Tuple[Rule, ...] = (
    Rule("trainer.steps", at_least(1), "an integer >= 1 (optimizer steps to run)"),
    Rule("trainer.global_batch_size", at_least(1), "an integer >= 1"),
    Rule("trainer.micro_batch_size", at_least(1), "an integer >= 1"),
    Rule("trainer.seq_len", at_least(1), "an integer >= 1 (tokens per sample)"),
    Rule("trainer.log_every", at_least(1), "an integer >= 1"),
    Rule("trainer.seed", at_least(0), "an integer >= 0"),
    Rule("model.vocab_size", lambda x: x == "auto" or (isinstance(x, int) and not isinstance(x, bool) and x >= 2),
         "an integer >= 2, or auto (the data tokenizer's vocabulary, resolved when the run starts)"),
    Rule("model.d_model", at_least(2), "an integer >= 2 (the hidden size)"),
    Rule("model.n_layers", at_least(1), "an integer >= 1"),
    Rule("model.n_heads", at_least(1), "an integer >= 1 dividing model.d_model"),
    Rule("model.n_kv_heads", optional(at_least(1)), "null (= n_heads) or an integer >= 1 dividing model.n_heads"),
    Rule("model.ffn_hidden", optional(at_least(1)), "null (Llama's 8h/3 rule) or an integer >= 1"),
    Rule("model.ffn_multiple_of", at_least(1), "an integer >= 1"),
    Rule("model.max_seq_len", at_least(1), "an integer >= 1"),
    Rule("model.rope_theta", above(0), "a finite number > 0", "the usual is 10000 or 500000"),
    Rule("model.norm_eps", above(0), "a finite number > 0", "the usual is 1e-5"),
    Rule("model.init_std", lambda x: _real(x) and 0 < x < 1, "a finite number in (0, 1)", "the usual is 0.02"),
    Rule("model.vocab_pad_to", optional(at_least(1)), "null or an integer >= 1"),
    Rule("model.rope_scaling.beta_fast", above(0), "a finite number > 0 (yarn)", "DeepSeek-V3's is 32"),
    Rule("model.rope_scaling.beta_slow", above(0), "a finite number > 0 (yarn)", "DeepSeek-V3's is 1"),
    Rule("model.rope_scaling.mscale", optional(above(0)), "null or a finite number > 0 (yarn)"),
    Rule("model.rope_scaling.mscale_all_dim", optional(above(0)), "null or a finite number > 0 (yarn)"),
    Rule("optim.lr", above(0), "a finite number > 0", "the usual is 1e-4 to 3e-3"),
    Rule("optim.min_lr_ratio", within(0, 1), "a number in [0, 1] (the final fraction of lr)"),
    Rule("optim.weight_decay", at_least(0), "a finite number >= 0", "0 turns it off"),
    Rule("optim.beta1", within(0, 1, hi_open=True), "a number in [0, 1)", "the usual is 0.9"),
    Rule("optim.beta2", within(0, 1, hi_open=True), "a number in [0, 1)", "the usual is 0.95 or 0.999"),
    Rule("optim.eps", above(0), "a finite number > 0", "the usual is 1e-8"),
    Rule("optim.warmup_steps", at_least(0), "an integer >= 0", "0 starts at the full lr"),
    Rule("optim.grad_clip", at_least(0), "a finite number >= 0", "0 turns clipping off"),
    Rule("optim.momentum", within(0, 1, hi_open=True), "a number in [0, 1)", "the usual is 0.9 (LARS) or 0.95 (Muon)"),
    Rule("optim.trust_coefficient", above(0), "a finite number > 0", "LARS's usual is 0.001 to 0.02"),
    Rule("optim.ns_steps", lambda x: isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= 99,
         "an integer in [1, 99] (Newton-Schulz iterations)", "the usual is 5"),
    Rule("optim.outer.every", at_least(1), "an integer >= 1 (inner steps between outer steps)",
         "1 averages after every step; the DiLoCo paper uses 500"),
    Rule("optim.outer.lr", above(0), "a finite number > 0", "the usual is 0.7; 1 with momentum 0 is a plain average"),
    Rule("optim.outer.momentum", within(0, 1, hi_open=True), "a number in [0, 1)", "the usual is 0.9"),
    Rule("comm.bucket_mb", at_least(0), "a finite number of MiB >= 0", "0: one bucket per parameter; the usual is 25"),
    Rule("comm.timeout_s", above(0), "a finite number of seconds > 0"),
    Rule("checkpoint.every", at_least(0), "an integer >= 0", "0 turns periodic saves off"),
    Rule("checkpoint.keep", at_least(0), "an integer >= 0", "0 keeps every checkpoint"),
    Rule("checkpoint.local.every", at_least(0), "an integer >= 0", "0 turns the local tier off"),
    Rule("checkpoint.local.replicas", at_least(0), "an integer >= 0 and below the number of nodes",
         "0 keeps no partner copy"),
    Rule("data.seed", at_least(0), "an integer >= 0"),
    Rule("data.embedded_bytes", at_least(1024), "an integer >= 1024"),
    Rule("data.split", within(0, 1, hi_open=True), "a fraction in [0, 1) of each source's documents",
         "0 holds none out; the usual is 0.001 to 0.01"),
    Rule("trainer.eval_every", at_least(0), "an integer >= 0", "0: validate only after the last step"),
    Rule("trainer.eval_batches", at_least(1), "an integer >= 1 (global batches per validation source)"),
    Rule("parallel.tp", at_least(1), "an integer >= 1"),
    Rule("parallel.pp", at_least(1), "an integer >= 1"),
    Rule("parallel.cp", at_least(1), "an integer >= 1"),
    Rule("parallel.ep", at_least(1), "an integer >= 1"),
    Rule("parallel.dp", lambda x: x == -1 or at_least(1)(x), "-1 (the rest of the world) or an integer >= 1"),
    Rule("reliability.max_skips", at_least(1), "an integer >= 1"),
    Rule("reliability.spike_window", at_least(2), "an integer >= 2"),
    Rule("reliability.spike_zscore", above(0), "a finite number > 0", "the usual is 6"),
    Rule("reliability.weight_check_every", at_least(0), "an integer >= 0", "0 turns the check off"),
    Rule("reliability.straggler_every", at_least(0), "an integer >= 0", "0 turns the report off"),
    Rule("reliability.straggler_factor", above(1), "a finite number > 1", "the usual is 1.5"),
    Rule("reliability.straggler_stop_after", at_least(0), "an integer >= 0",
         "0 names stragglers only; N stops the run after N reports in a row naming the same ranks"),
    Rule("reliability.straggler_min_s", optional(at_least(0)),
         "null (max(10 ms, 5% of the step time)) or a finite number of seconds >= 0", "0: the factor alone"),
    Rule("trainer.loss_scale.initial", within(2.0**-14, 2.0**32),
         "a number in [6.1e-05, 4.3e+09] (2^-14, fp16's smallest normal number, below which the scaled "
         "gradients underflow, to 2^32; a larger one only costs skipped steps while it backs off)",
         "the usual is 65536 (2^16)"),
    Rule("trainer.loss_scale.growth_interval", at_least(1), "an integer >= 1 (clean steps before the scale grows)",
         "the usual is 2000"),
    Rule("trainer.loss_scale.backoff", lambda x: _real(x) and 0 < x < 1, "a number in (0, 1)", "the usual is 0.5"),
    Rule("trainer.loss_scale.growth", above(1), "a finite number > 1", "the usual is 2"),
    Rule("trainer.end_margin_s", at_least(0), "a finite number of seconds >= 0"),
    Rule("reliability.hang_timeout_s", lambda x: x == 0 or at_least(1)(x), "0 (off) or a finite number >= 1",
         "the usual is 600; set it above your slowest checkpoint save"),
    Rule("debug.fault", lambda x: x in FAULTS, f"one of {', '.join(FAULTS)}"),
    Rule("debug.fault_at", lambda x: x in ("step", "checkpoint"), "step or checkpoint"),
    Rule("debug.fault_rank", at_least(-1), "a world rank >= 0, or -1 (every rank)"),
    Rule("debug.fault_step", at_least(1), "an integer >= 1"),
    Rule("debug.slow_s", at_least(0), "a finite number >= 0"),
    Rule("debug.comm_delay_axis", lambda x: x in ("none",) + AXES, f"one of none, {', '.join(AXES)}"),
    Rule("debug.comm_delay_ms", at_least(0), "a finite number of milliseconds >= 0"),
    Rule("finetune.method", lambda x: x in FINETUNE_METHODS, f"one of {', '.join(FINETUNE_METHODS)}"),
    Rule("finetune.lora.rank", at_least(1), "an integer >= 1 (the adapters' inner size)", "the usual is 8 to 64"),
    Rule("finetune.lora.alpha", above(0), "a finite number > 0 (updates scale by alpha / rank)",
         "the usual is twice the rank"),
    Rule("finetune.lora.dropout", within(0, 1, hi_open=True), "a number in [0, 1)", "0 turns it off"),
    Rule("finetune.lora.targets",
         lambda x: x is not None and len(x) > 0 and all(t in LORA_TARGETS for t in x),
         f"a non-empty list of projections out of {', '.join(LORA_TARGETS)}", "e.g. [q,k,v,o]"),
    Rule("finetune.lora.experts", lambda x: x is False, "false: adapters on MoE experts are not implemented yet",
         "gate/up/down then adapt dense SwiGLU blocks only"),
    Rule("cluster.gpus", at_least(0), "an integer >= 0"),
    Rule("cluster.gpus_per_node", at_least(0), "an integer >= 0"),
    Rule("cluster.gpu_mem_gb", at_least(0), "a finite number >= 0"),
    Rule("cluster.peak_tflops", at_least(0), "a finite number >= 0"),
    Rule("cluster.intra_bw_gbs", at_least(0), "a finite number >= 0"),
    Rule("cluster.inter_bw_gbs", at_least(0), "a finite number >= 0"),
    Rule("report.target_tokens", at_least(0), "an integer >= 0 (tokens to project the usage for)", "0: none"),
)


def range_problems(cfg: Any) -> List[str]:
    """One message per value outside its rule's range."""
    out = []
    for rule in RULES:
        value = OmegaConf.select(cfg, rule.key, default=None) if OmegaConf.is_config(cfg) else _get(cfg, rule.key)
        if rule.ok(value):
            continue
        out.append(f"{rule.key}={value!r}: must be {rule.need}" + (f"; {rule.fix}" if rule.fix else ""))
    return out


def _get(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part, None)
    return cfg
