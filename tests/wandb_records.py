"""Reading an offline W&B run file (``run-<id>.wandb``) back, for the logger tests.

W&B's LevelDB-log framing: a 7-byte header (``:W&B``, magic, version), 32 KiB
blocks, each record one or more chunks of crc32 + length + type (FULL 1,
FIRST 2, MIDDLE 3, LAST 4) holding a protobuf ``Record`` (``wandb.proto``).
wandb >= 0.20 has no Python reader left (the Go service that writes the
file also reads it for ``wandb sync``).
"""
from __future__ import annotations

import json
import struct
from typing import Any, Dict, Iterator, List


def records(path: str) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", data[:7]
    pos, block, chunks = 7, 32768, []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunks.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: one record is complete
            record = pb.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            yield record


def history(path: str) -> List[Dict[str, Any]]:
    """Every ``run.log`` row, ``_step`` included."""
    return [{(i.key or ".".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            for r in records(path) if r.WhichOneof("record_type") == "history"]


def run_group(path: str) -> str:
    return next(r.run.run_group for r in records(path) if r.WhichOneof("record_type") == "run")
