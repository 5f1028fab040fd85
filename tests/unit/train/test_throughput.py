"""MFU in the log equals the formula for the run's model, tokens and time
(a 2-step run): 6N + 12 l h s model FLOPs per token (PaLM, appendix B), N
the parameters but the input embedding (a lookup, no multiply), counted here
from the real model, not from the planner the trainer takes it from."""
from __future__ import annotations

import logging
import re

import pytest

from hpctrain.run import reference_trainer

PEAK_TFLOPS = 0.05


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _non_embedding_params(model) -> int:
    return sum(p.numel() for name, p in model.named_parameters() if "embed" not in name)


def test_mfu_in_the_log_is_the_formula_of_the_model_tokens_and_time(make_config, pm):
    cfg = make_config("trainer.steps=2", "trainer.log_every=1", f"cluster.peak_tflops={PEAK_TFLOPS}",
                      "trainer.progress=off")
    trainer = reference_trainer(cfg, pm)
    lines = _Lines()
    logging.getLogger("hpctrain").addHandler(lines)
    try:
        history = trainer.fit()
    finally:
        logging.getLogger("hpctrain").removeHandler(lines)
    m = cfg.model
    n = _non_embedding_params(trainer.model)
    # tiny: 2 blocks of GQA (4 query, 2 key/value heads), SwiGLU 192 wide, 2 norms; final norm; output 256 x 64
    assert n == 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 192 + 2 * 64) + 64 + 256 * 64
    per_token = 6 * n + 12 * m.n_layers * m.d_model * cfg.trainer.seq_len
    tokens = cfg.trainer.global_batch_size * cfg.trainer.seq_len
    step_lines = [ln for ln in lines.lines if ln.startswith("step ")]
    assert len(step_lines) == len(history) == 2
    for rec, line in zip(history, step_lines):
        want = per_token * tokens / rec["step_time_s"] / 1 / (PEAK_TFLOPS * 1e12)
        assert rec["mfu"] == pytest.approx(want, rel=1e-12)
        assert rec["model_tflops_per_device"] == pytest.approx(want * PEAK_TFLOPS, rel=1e-12)
        assert rec["tokens_per_s_per_device"] == pytest.approx(tokens / rec["step_time_s"], rel=1e-12)
        shown = float(re.search(r"MFU ([0-9.]+)%", line).group(1))
        assert shown == pytest.approx(100 * want, abs=0.05), line
        assert f"{rec['tokens_per_s_per_device']:,.0f} tok/s/device ({rec['tokens_per_s']:,.0f} tok/s global)" in line


def test_no_peak_no_mfu(make_config, pm):
    history = reference_trainer(make_config("trainer.steps=1", "trainer.progress=off"), pm).fit()
    assert "mfu" not in history[0] and history[0]["model_tflops_per_device"] > 0
