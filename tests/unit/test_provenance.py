"""hpctrain.provenance: the job's shape, the data manifest's hash, what a changed stack looks like, the lines
hpctrain-ckpt inspect prints. A real checkpoint's record, inspect and a changed-stack resume:
tests/unit/checkpoint/test_ckpt_tools.py."""
from __future__ import annotations

import hashlib
import shutil

from omegaconf import OmegaConf

from hpctrain import provenance


def test_the_job_from_every_ranks_host_and_slurms_variables():
    env = {"SLURM_JOB_ID": "77", "SLURM_ARRAY_JOB_ID": "70", "SLURM_ARRAY_TASK_ID": "3", "OTHER": "x"}
    got = provenance.job(["n2", "n2", "n1", "n1"], env)
    assert got == {"world_size": 4, "nodes": ["n2", "n1"], "ranks_per_node": 2,
                   "slurm": {"job_id": "77", "array_job_id": "70", "array_task_id": "3"}}
    assert provenance.job(["a", "a", "b"], {})["ranks_per_node"] == {"a": 2, "b": 1}  # uneven: per node
    assert "slurm" not in provenance.job(["a"], {})


def _shard(d, name, idx=b"\x01\x02", bin_=b"\x00" * 8):
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{name}.idx").write_bytes(idx)
    (d / f"{name}.bin").write_bytes(bin_)
    return str(d / name)


def _hash(data):
    return provenance.record(b"x", OmegaConf.create(data), ["h"])["data"]


def test_the_data_hash_follows_the_tokens_not_the_directory(tmp_path):
    a = _shard(tmp_path / "a", "web")
    data = {"source": "indexed", "paths": [a], "split": 0.0, "seed": 1, "validation": {"paths": []}}
    first = _hash(data)
    assert first["shards"] == 1
    shutil.copytree(tmp_path / "a", tmp_path / "moved")
    assert _hash({**data, "paths": [str(tmp_path / "moved" / "web")]}) == first  # moved: the same data
    _shard(tmp_path / "a", "web", idx=b"\x01\x03")  # retokenised: other document lengths
    assert _hash(data)["sha256"] != first["sha256"]
    assert _hash({**data, "seed": 2})["sha256"] != first["sha256"]  # another sample order
    builtin = {"source": "embedded", "seed": 1}
    assert _hash(builtin) == _hash(builtin) and _hash(builtin) != _hash({**builtin, "seed": 2})


def test_the_record_and_its_lines():
    rec = provenance.record(b"trainer: {}\n", OmegaConf.create({"source": "embedded"}), ["n1", "n1"])
    assert rec["config_sha256"] == hashlib.sha256(b"trainer: {}\n").hexdigest()
    assert {"hpctrain", "python", "torch", "numpy"} <= set(rec["software"])
    text = "\n".join(provenance.lines(rec))
    assert "2 ranks on 1 node(s) (n1), 2 per node" in text and f"torch {rec['software']['torch']}" in text
    assert provenance.parse(None) is None and provenance.parse("[1]") is None and provenance.parse("{") is None


def test_a_changed_stack_is_named_key_by_key():
    saved = {"software": {"torch": "2.12.0", "mpi": "Open MPI v4.1.4", "nccl": "2.21.5"}}
    now = {"torch": "2.13.0", "mpi": "Open MPI v4.1.4", "hdf5": "1.10.8"}
    assert provenance.stack_changes(saved, now) == ["hdf5: (none) -> 1.10.8", "nccl: 2.21.5 -> (none)",
                                                    "torch: 2.12.0 -> 2.13.0"]
    assert provenance.stack_changes(saved, dict(saved["software"])) == []
    assert provenance.stack_changes(None, now) == []  # an older checkpoint: nothing to compare
