"""Each step's record reaches metrics.jsonl whole when it is logged, not when a 64 KiB buffer fills
(which cut lines anywhere, so a reader of a running or killed run met a partial line), and not only
at the log steps' ``flush``."""
from __future__ import annotations

import json

from hpctrain.train.loggers import JsonlLogger, Loggers


def test_every_record_is_in_the_file_once_logged(tmp_path):
    path = tmp_path / "metrics.jsonl"
    loggers = Loggers([JsonlLogger(str(path))])
    try:
        for step in range(1, 4):
            loggers.log({"step": step, "loss": 1.0 / step, "note": "x" * 30_000})  # 3 records > 64 KiB
            text = path.read_text()
            assert text.endswith("\n") and [json.loads(line)["step"] for line in text.splitlines()] == \
                list(range(1, step + 1))
    finally:
        loggers.close()
