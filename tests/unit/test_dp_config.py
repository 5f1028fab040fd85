"""The data-parallel plugin's config section and validation (one process)."""
from __future__ import annotations

import pytest

from hpctrain.config.validate import validate


def test_defaults_are_uncompressed_and_overlapped(make_config):
    cfg = make_config()
    assert cfg.comm.dp.compress == "none" and cfg.comm.dp.overlap is True
    assert cfg.comm.bucket_mb == 25.0


def test_overrides_are_typed(make_config):
    cfg = make_config("comm.dp.compress=bf16", "comm.dp.overlap=false", "comm.bucket_mb=0.01")
    assert cfg.comm.dp.compress == "bf16" and cfg.comm.dp.overlap is False and cfg.comm.bucket_mb == 0.01
    with pytest.raises(Exception, match="overlap"):
        make_config("comm.dp.overlap=sometimes")
    with pytest.raises(Exception, match="compres"):
        make_config("comm.dp.compres=bf16")


def test_bad_values_are_named_with_the_fix(make_config, pm):
    problems = validate(make_config("comm.dp.compress=int8"), 2, pm)
    assert any("comm.dp.compress='int8' is not one of none, bf16, fp16" in p for p in problems)
    problems = validate(make_config("comm.bucket_mb=-1"), 2, pm)  # the core's range table
    assert any("comm.bucket_mb=-1.0: must be a finite number of MiB >= 0" in p for p in problems)
    assert validate(make_config("comm.dp.compress=fp16", "comm.bucket_mb=0"), 2, pm) == []
