"""Bootstrap: who am I, where am I, and which device do I use.

mpi4py gives the world rank and size under any launcher (``srun --mpi=pmix``,
``mpirun``, or a plain one-process ``python``). The node of a rank comes from
``Split_type(COMM_TYPE_SHARED)``; ``HPCTRAIN_RANKS_PER_NODE=k`` instead
pretends consecutive blocks of k ranks are nodes, so topology-aware code (the
hierarchical backend) is tested on one machine.

torch.distributed is initialised only when a torch backend asks for it, by a
rendezvous broadcast over MPI: rank 0 binds a free port, broadcasts
``host:port``, and every rank joins. No MASTER_ADDR guessing; set
``HPCTRAIN_MASTER_ADDR`` to force the address rank 0 advertises (for example
the high-speed interface's IP).
"""
from __future__ import annotations

import atexit
import datetime
import os
import socket
import time
from dataclasses import dataclass, replace
from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist

from hpctrain.errors import ConfigError
from hpctrain.log import get_logger, setup_logging

RANKS_PER_NODE_ENV = "HPCTRAIN_RANKS_PER_NODE"
MASTER_ADDR_ENV = "HPCTRAIN_MASTER_ADDR"


@dataclass(frozen=True)
class Runtime:
    """This process's place in the job. Created once per process."""

    world_rank: int
    world_size: int
    local_rank: int
    local_size: int
    node_rank: int
    num_nodes: int
    hostname: str
    device: torch.device
    mpi_comm: Any  # mpi4py.MPI.Comm (the world); Any to keep the type import-free
    emulated_nodes: bool = False
    rank_nodes: Tuple[int, ...] = ()
    """Node index of every world rank (``rank_nodes[r]``), for topology-aware backends."""

    @property
    def is_main(self) -> bool:
        return self.world_rank == 0


_runtime: Optional[Runtime] = None


def _import_mpi():
    try:
        from mpi4py import MPI  # MPI starts here, in init_runtime, never at import
    except ImportError as e:  # pragma: no cover - mpi4py is a hard dependency
        raise RuntimeError(
            f"mpi4py cannot load an MPI library ({e}); install one (apt install openmpi-bin, "
            "or `module load openmpi` on a cluster) and reinstall mpi4py against it"
        ) from e
    return MPI


def choose_device(request: str, local_rank: int) -> torch.device:
    """``auto``: cuda:local_rank when CUDA is present, else cpu."""
    if request not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"trainer.device={request!r} is not one of auto, cpu, cuda")
    if request == "cpu" or (request == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but torch sees no GPU; use trainer.device=cpu or install a CUDA torch")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def _topology(comm, MPI):
    """(local_rank, local_size, node_rank, num_nodes, emulated)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    per_node = os.environ.get(RANKS_PER_NODE_ENV)
    if per_node:
        k = int(per_node)
        if k <= 0 or size % k:
            raise ConfigError(f"{RANKS_PER_NODE_ENV}={per_node} must divide the world size {size}")
        return rank % k, k, rank // k, size // k, True
    node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_size = node_comm.Get_rank(), node_comm.Get_size()
    leaders = comm.Split(0 if local_rank == 0 else MPI.UNDEFINED, key=rank)
    info = (leaders.Get_rank(), leaders.Get_size()) if local_rank == 0 else None
    if leaders != MPI.COMM_NULL:
        leaders.Free()
    node_rank, num_nodes = node_comm.bcast(info, root=0)
    node_comm.Free()
    return local_rank, local_size, node_rank, num_nodes, False


def init_runtime(device: str = "auto") -> Runtime:
    """Initialise MPI (if the launcher did not) and describe this process."""
    global _runtime
    if _runtime is not None:
        return _runtime
    MPI = _import_mpi()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    setup_logging(rank, size)
    local_rank, local_size, node_rank, num_nodes, emulated = _topology(comm, MPI)
    # emulated nodes are blocks of consecutive ranks; real ones need one allgather
    rank_nodes = tuple(r // local_size for r in range(size)) if emulated else tuple(comm.allgather(node_rank))
    _runtime = Runtime(
        world_rank=rank,
        world_size=size,
        local_rank=local_rank,
        local_size=local_size,
        node_rank=node_rank,
        num_nodes=num_nodes,
        hostname=socket.gethostname(),
        device=choose_device(device, local_rank),
        mpi_comm=comm,
        emulated_nodes=emulated,
        rank_nodes=rank_nodes,
    )
    return _runtime


def job_nodes(world_size: int) -> int:
    """The number of nodes, for validation (no collective): the runtime's when
    it exists, else what ``HPCTRAIN_RANKS_PER_NODE`` makes of ``world_size``, else 1."""
    if _runtime is not None:
        return _runtime.num_nodes
    per_node = os.environ.get(RANKS_PER_NODE_ENV, "")
    if per_node.isdigit() and int(per_node) > 0:
        return max(1, world_size // int(per_node))
    return 1


def get_runtime() -> Runtime:
    if _runtime is None:
        return init_runtime()
    return _runtime


def with_device(device: str) -> Runtime:
    """The runtime with its device chosen from ``trainer.device``."""
    global _runtime
    rt = get_runtime()
    dev = choose_device(device, rt.local_rank)
    if dev != rt.device:
        rt = _runtime = replace(rt, device=dev)
    return rt


def advertised_address() -> str:
    """The address rank 0 tells the others to connect to (``HPCTRAIN_MASTER_ADDR`` forces it):
    the host name's address, or, where that is a loopback address (Debian's
    /etc/hosts maps the host name to 127.0.1.1), the address of the
    interface the default route leaves by (a UDP socket's local end; no
    packet is sent)."""
    forced = os.environ.get(MASTER_ADDR_ENV)
    if forced:
        return forced
    try:
        addr = socket.gethostbyname(socket.gethostname())
    except OSError:
        addr = "127.0.0.1"
    if addr.startswith("127."):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect(("10.255.255.255", 1))
                addr = probe.getsockname()[0]
        except OSError:
            pass
    return addr


def init_torch_distributed(backend: str, timeout_s: float = 600.0) -> None:
    """Join the default torch process group (idempotent), rendezvous over MPI."""
    if dist.is_initialized():
        return
    rt = get_runtime()
    if rt.is_main:
        addr = advertised_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        endpoint = f"{addr}:{port}"
    else:
        endpoint = None
    endpoint = rt.mpi_comm.bcast(endpoint, root=0)
    get_logger(__name__).debug("torch.distributed rendezvous at %s (%s)", endpoint, backend)
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{endpoint}",
        rank=rt.world_rank,
        world_size=rt.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    atexit.register(shutdown_torch_distributed)


def shutdown_torch_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def idle_wait(comm: Any, poll_s: float = 0.01) -> None:
    """Wait for every rank of ``comm`` in a non-blocking barrier polled with sleeps. A
    blocking collective polls busily, taking the cores from a rank that works while
    the others wait (rank 0 running ``hpctrain-parity``'s one-process reference) where
    ranks share cores (the tests, a laptop). Every rank of ``comm`` calls it: MPI
    matches a non-blocking barrier only with another one."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(poll_s)


def shutdown() -> None:
    """Tear down torch.distributed; MPI finalises itself at exit (mpi4py)."""
    shutdown_torch_distributed()
