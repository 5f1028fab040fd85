"""Where a checkpoint came from: the software, the job, the config and the data (stored in every checkpoint).

A record is plain JSON, one attribute of the checkpoint (the HDF5 format's
``/meta`` attribute ``provenance``; ``hpctrain-ckpt inspect`` prints it)::

    software  hpctrain (and its git commit when installed from a checkout, with
              "+dirty" for uncommitted changes to tracked files), python, torch,
              numpy, mpi4py, the MPI library, h5py and HDF5 (when loaded), CUDA,
              cuDNN, NCCL and the GPU (where present)
    job       nodes (in rank order), ranks per node, world size, and under
              Slurm the job id, array job id and task index, restart count
    config    sha256 of the resolved config (the text the checkpoint stores)
    data      sha256 of the data manifest (``data_manifest``) and its shard count

A resume compares the software it runs on with the record's and logs one
block naming what differs (``stack_changes``): information, never an error,
since a newer torch or MPI should load an older checkpoint.

The data manifest: for indexed data, each shard's name (not its directory:
moving the data keeps the hash), its ``.bin`` size and its ``.idx``'s sha256
(the documents' lengths and offsets: a retokenised corpus differs, a copied
one does not), and the sha256 of any ``hpctrain-prepare`` manifest named;
for built-in data, its config section. Rank 0 computes it once per run.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
from collections import Counter
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch
from omegaconf import OmegaConf

import hpctrain

ATTR = "provenance"
"""The name the record is stored under (the HDF5 format: a ``/meta`` attribute, JSON)."""

_CHUNK = 1 << 20


@functools.lru_cache(maxsize=1)
def git_commit() -> Optional[str]:
    """The commit of the checkout hpctrain is imported from (``+dirty`` with uncommitted changes to tracked
    files), or None for an installed wheel or without git."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(hpctrain.__file__)))
    if not os.path.exists(os.path.join(repo, ".git")):
        return None
    try:
        head = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", repo, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def software() -> Dict[str, str]:
    """The versions of what this process runs on (see the module docstring)."""
    out = {"hpctrain": str(hpctrain.__version__), "python": sys.version.split()[0], "torch": torch.__version__,
           "numpy": np.__version__}
    commit = git_commit()
    if commit:
        out["hpctrain_git"] = commit
    if "mpi4py" in sys.modules:
        # already imported where MPI runs; importing it here would start MPI in a process that has none
        import mpi4py.MPI

        out["mpi4py"] = mpi4py.__version__
        out["mpi"] = mpi4py.MPI.Get_library_version().split("\x00")[0].splitlines()[0].strip()
    h5py = sys.modules.get("h5py")
    if h5py is not None:
        out["h5py"], out["hdf5"] = h5py.version.version, h5py.version.hdf5_version
    if torch.version.cuda:
        out["cuda"] = str(torch.version.cuda)
        cudnn = torch.backends.cudnn.version()
        if cudnn:
            out["cudnn"] = str(cudnn)
    if torch.cuda.is_available():
        try:
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except (AttributeError, RuntimeError):
            pass
        out["gpu"] = torch.cuda.get_device_name()
    return out


def job(hosts: Sequence[str], env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """The job's shape from every rank's host name (``hosts[rank]``) and Slurm's variables."""
    env = dict(os.environ if env is None else env)
    per_node = Counter(hosts)
    nodes = list(dict.fromkeys(hosts))  # in rank order
    counts = {per_node[n] for n in nodes}
    out: Dict[str, Any] = {"world_size": len(hosts), "nodes": nodes,
                           "ranks_per_node": counts.pop() if len(counts) == 1 else {n: per_node[n] for n in nodes}}
    slurm = {key: env[var] for key, var in (("job_id", "SLURM_JOB_ID"), ("array_job_id", "SLURM_ARRAY_JOB_ID"),
                                              ("array_task_id", "SLURM_ARRAY_TASK_ID"),
                                              ("restart_count", "SLURM_RESTART_COUNT")) if env.get(var)}
    if slurm:
        out["slurm"] = slurm
    return out


def config_sha256(text: bytes) -> str:
    """The hash of the resolved config's YAML text (what the checkpoint stores beside it)."""
    return hashlib.sha256(text).hexdigest()


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def data_manifest(data: Any) -> Dict[str, Any]:
    """What identifies the data a run reads (module docstring); shards that cannot be read are named with
    their error (validation refuses such a run before it saves)."""
    from hpctrain.data.index import resolve  # (data: only when a checkpoint records it)

    section: Dict[str, Any] = dict(OmegaConf.to_container(data, resolve=True)  # type: ignore[arg-type]
                                   if OmegaConf.is_config(data) else data)
    if str(section.get("source")) == "tokens" and section.get("path"):
        path = str(section["path"])  # one token file: its size and its sidecar (dtype, vocabulary, tokens)
        sidecar = os.path.splitext(path)[0] + ".json"
        return {"source": "tokens", "name": os.path.basename(path),
                "bytes": os.path.getsize(path) if os.path.isfile(path) else None,
                "sidecar_sha256": _file_sha256(sidecar) if os.path.isfile(sidecar) else None}
    if str(section.get("source")) != "indexed":
        return {"source": section.get("source"), "config": section}
    entries = [str(p) for p in section.get("paths") or []]
    for part in section.get("blend") or []:
        entries += [str(p) for p in (part.get("paths") or [])]
    entries += [str(p) for p in ((section.get("validation") or {}).get("paths") or [])]
    shards: List[Dict[str, Any]] = []
    manifests = []
    for entry in entries:
        if entry.endswith(".json") and os.path.isfile(entry):
            manifests.append({"name": os.path.basename(entry), "sha256": _file_sha256(entry)})
        prefixes, _, _ = resolve([entry], "data")
        for prefix in prefixes:
            try:
                shards.append({"name": os.path.basename(prefix), "bin_bytes": os.path.getsize(prefix + ".bin"),
                               "idx_sha256": _file_sha256(prefix + ".idx")})
            except OSError as e:
                shards.append({"name": os.path.basename(prefix), "error": str(e)})
    return {"source": "indexed", "split": section.get("split"), "seed": section.get("seed"), "shards": shards,
            "manifests": manifests}


def record(config_text: bytes, data: Any, hosts: Sequence[str], extra: Optional[Dict[str, str]] = None
           ) -> Dict[str, Any]:
    """A checkpoint's provenance (rank 0, once per run: the data manifest reads every ``.idx``)."""
    manifest = data_manifest(data)
    return {"software": {**software(), **(extra or {})}, "job": job(hosts),
            "config_sha256": config_sha256(config_text),
            "data": {"sha256": hashlib.sha256(json.dumps(manifest, sort_keys=True, default=str).encode()).hexdigest(),
                     "shards": len(manifest.get("shards", []))}}


def parse(text: Any) -> Optional[Dict[str, Any]]:
    """A stored record (JSON text), None for older checkpoints or an unreadable one."""
    try:
        found = json.loads(text) if text else None
    except (TypeError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def stack_changes(saved: Optional[Dict[str, Any]], now: Dict[str, str]) -> List[str]:
    """``name: saved -> now`` for every piece of software that differs (or is present on one side only)
    between a record and this process; empty when the stack is the same or nothing was recorded."""
    if not saved:
        return []
    before = saved.get("software", {})
    return [f"{key}: {before.get(key, '(none)')} -> {now.get(key, '(none)')}"
            for key in sorted(set(before) | set(now)) if before.get(key) != now.get(key)]


def lines(saved: Dict[str, Any]) -> List[str]:
    """The record as ``hpctrain-ckpt inspect`` prints it."""
    sw, jb, data = saved.get("software", {}), saved.get("job", {}), saved.get("data", {})
    out = ["software    " + ", ".join(f"{k} {v}" for k, v in sw.items())]
    nodes = jb.get("nodes", [])
    shown = ", ".join(nodes[:8]) + (f" and {len(nodes) - 8} more" if len(nodes) > 8 else "")
    out.append(f"job         {jb.get('world_size', '?')} ranks on {len(nodes)} node(s) ({shown}), "
               f"{jb.get('ranks_per_node', '?')} per node"
               + "".join(f", slurm {k} {v}" for k, v in jb.get("slurm", {}).items()))
    out.append(f"config      sha256 {saved.get('config_sha256', '?')}")
    out.append(f"data        sha256 {data.get('sha256', '?')} ({data.get('shards', 0)} shard(s))")
    return out
