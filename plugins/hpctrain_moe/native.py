"""The dispatch plan's integer work in C on CPU (``plan.c``), through ctypes.

In Python the plan's sort, bags and offsets are a dozen small tensor
operations; in the token path they run between the ranks' exchanges, on cold
caches, where each costs several times its warm figure (docs/benchmarks.md,
"the token path's fixed cost"). One C call does them in two passes.

Built at first use with the C compiler Python was built with, or ``cc``
(``CC`` overrides it), into ``$HPCTRAIN_CACHE_DIR`` (default
``$XDG_CACHE_HOME/hpctrain``, else ``~/.cache/hpctrain``), one file per
source and compiler, written under a temporary name and renamed, so ranks
that build at once on a shared file system do not see each other's half
files. Where that fails (no compiler, a read-only cache) or
``HPCTRAIN_MOE_NATIVE=0``, ``library()`` is None and the plan runs in
torch: the same results (a unit test holds the two to that), slower.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import shutil
import socket
import subprocess
import sysconfig
from pathlib import Path
from typing import List, Optional, Tuple

import torch

from hpctrain.log import get_logger

log = get_logger(__name__)

SOURCE = Path(__file__).with_name("plan.c")
_FLAGS = ["-O2", "-shared", "-fPIC"]

_library: Optional[ctypes.CDLL] = None
_tried = False


def compiler() -> List[str]:
    """The C compiler command: ``CC``, else the one Python was built with where this machine
    has it (a Python built elsewhere may name a compiler it does not), else ``cc``."""
    given = os.environ.get("CC")
    if given:
        return shlex.split(given)
    built_with = shlex.split(sysconfig.get_config_var("CC") or "")
    return built_with if built_with and shutil.which(built_with[0]) else ["cc"]


def cache_dir() -> Path:
    given = os.environ.get("HPCTRAIN_CACHE_DIR")
    if given:
        return Path(given)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hpctrain"


def build() -> Path:
    """The shared library of ``plan.c``, compiled unless this source and compiler's is cached."""
    cc = compiler()
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(cc + _FLAGS).encode()).hexdigest()[:16]
    target = cache_dir() / f"moe_plan-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{target.name}.{socket.gethostname()}.{os.getpid()}.tmp")  # (shared file systems)
        try:
            subprocess.run([*cc, *_FLAGS, "-o", str(partial), str(SOURCE)], check=True, capture_output=True,
                           timeout=120)
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    return target


def library() -> Optional[ctypes.CDLL]:
    """The loaded ``plan.c`` (built at the first call in the process), or None where it cannot be."""
    global _library, _tried
    if not _tried:
        _tried = True
        _library = _load() if os.environ.get("HPCTRAIN_MOE_NATIVE", "1") != "0" else None
    return _library


def _load() -> Optional[ctypes.CDLL]:
    try:
        lib = ctypes.CDLL(str(build()))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        log.debug("the MoE plan runs in torch: %s building %s: %s %s", type(e).__name__, SOURCE.name, e,
                  detail.decode(errors="replace")[-500:])
        return None
    fn = lib.hpctrain_moe_plan
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 5 + [ctypes.c_void_p] * 6
    return lib


def plan(lib: ctypes.CDLL, experts: torch.Tensor, keep: Optional[torch.Tensor], num_experts: int,
         own_experts: Tuple[int, int], counts: torch.Tensor
         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(order, token, bag_rows, offsets, kept) of CPU (n, k) ``experts`` (see ``plan.c``);
    ``counts`` (E int64, contiguous) receives the assignments per expert."""
    n, k = experts.shape
    ids = experts if experts.dtype == torch.int64 and experts.is_contiguous() else experts.contiguous().long()
    mask = None if keep is None else keep.contiguous().to(torch.bool)
    slots = n * k
    # one allocation, five views (each torch call costs microseconds here, several times that on cold caches)
    order, token, bag, kept, offsets = torch.empty(4 * slots + n + 1, dtype=torch.int64).split([slots] * 4 + [n + 1])
    rows = lib.hpctrain_moe_plan(ids.data_ptr(), None if mask is None else mask.data_ptr(), n, k, num_experts,
                                 own_experts[0], own_experts[1], counts.data_ptr(), offsets.data_ptr(),
                                 kept.data_ptr(), order.data_ptr(), token.data_ptr(), bag.data_ptr())
    if rows < 0:
        if rows == -1:
            raise ValueError(f"plan_dispatch: expert ids outside [0, {num_experts})")
        raise MemoryError("plan_dispatch: no memory for the plan's expert cursors")
    if mask is None:
        return order, token, bag, offsets, None
    return order[:rows], token[:rows], bag[:rows], offsets, kept[:rows]
