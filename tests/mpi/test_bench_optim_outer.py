"""Smoke run of the DiLoCo section of ``hpctrain-bench optim``
(``hpctrain.bench._optim_outer.diloco_section``) at tiny sizes: a row per
contender, and the dp bytes per step against plain dp are 1/every (bf16 on
the wire: half that), as the section's theory column says. No timing is
asserted (benchmarks are not timed tests)."""
from __future__ import annotations

import pytest

TINY = ("model.d_model=64", "model.n_layers=1", "trainer.seq_len=32", "trainer.global_batch_size=4")


@pytest.mark.mpi(min_size=2)
def test_diloco_section_reports_every_contender(world):
    from hpctrain.bench._optim_outer import diloco_section

    out = diloco_section(world, TINY, every=(2,), iters=1, warmup=0)
    print(out)
    rows = {line.split("  ")[0].strip(): line.split() for line in out.splitlines()[3:]}
    assert list(rows) == ["plain dp", "DiLoCo every=2 (fp32)", "DiLoCo every=2 (bf16)"], out
    ratio = {name: float(cells[-2]) for name, cells in rows.items()}
    assert ratio["plain dp"] == 1.0
    for name, want in (("every=2 (fp32)", 1 / 2), ("every=2 (bf16)", 1 / 4)):
        assert abs(ratio[f"DiLoCo {name}"] - want) < 5e-3, out
