"""The step loop of torch's own parallel APIs, for benchmarks that run them
next to ours: the same model class, init, data, accumulation, clipping,
AdamW and schedule as ``Trainer.train_step``, with the model parallelised
by the peer API (FSDP2's ``fully_shard``, the tensor-parallel
``parallelize_module``) instead of our plugins."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from hpctrain.bench.common import make_config, refuse
from hpctrain.bootstrap import init_torch_distributed, with_device
from hpctrain.data import DataCursor, SampleOrder, open_source
from hpctrain.model.build import init_box
from hpctrain.optimizers.adamw import build_adamw
from hpctrain.plugins import get_manager
from hpctrain.run import configure_torch
from hpctrain.train.lr_schedule import lr_at, set_lr


def start(name: str, overrides: Callable[[int], List[str]]) -> Optional[Tuple[Any, Any, Any]]:
    """(config, runtime, plugin manager) of benchmark ``name`` on this MPI
    job, torch.distributed (gloo) up for the peer; None, said on stderr, with
    fewer than 2 ranks. ``overrides(world_size)`` gives the config overrides."""
    rt = with_device("cpu")
    if rt.world_size < 2:
        refuse(None, f"hpctrain-bench {name} needs at least 2 ranks; run it as mpiexec -n 2 hpctrain-bench {name}")
        return None
    pm = get_manager()
    cfg = make_config(overrides(rt.world_size), pm, rt)
    configure_torch(cfg, rt)
    init_torch_distributed("gloo", cfg.comm.timeout_s)
    return cfg, rt, pm


def fill_from_init(model: torch.nn.Module, specs: Dict[str, Any], cfg: Any) -> None:
    """Give every (possibly DTensor) parameter of a model made on the meta
    device its values from our per-tile init, drawing only its local box."""
    from torch.distributed.tensor import DTensor  # heavy: ~1 s of torch.distributed, only for the torch peer

    # heavy: ~1 s of torch.distributed, only for the torch peer
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements) \
                if isinstance(p, DTensor) else (p.shape, (0,) * p.dim())
            if local.numel():
                box = tuple((o, o + n) for o, n in zip(offset, shape))
                local.copy_(init_box(specs[name], box, cfg.trainer.seed, cfg.model.init_std, cfg.model.n_layers))


class PeerLoop:
    """One training step of ``model`` (already parallelised by a torch API).

    ``sample_rank``/``sample_size`` split the samples as our data axes
    would; ``loss_context`` wraps forward and backward (``loss_parallel``).
    """

    def __init__(self, cfg: Any, model: torch.nn.Module, sample_rank: int, sample_size: int,
                 loss_context: Callable[[], ContextManager] = contextlib.nullcontext):
        self.cfg, self.dist, self.model = cfg, dist, model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = build_adamw(self.params, cfg.optim)
        t = cfg.trainer
        self.cursor = DataCursor(SampleOrder(open_source(cfg.data), t.seq_len, cfg.data.seed), t.global_batch_size,
                                 t.micro_batch_size, sample_rank, sample_size)
        self.sample_size = sample_size
        self.loss_context = loss_context
        self.step_count = 0
        self.last_loss: Optional[float] = None

    def step(self) -> None:
        from torch.distributed.tensor import DTensor  # heavy: ~1 s of torch.distributed, only for the torch peer

        cfg = self.cfg
        micro = self.cursor.next_step()
        set_lr(self.optimizer, lr_at(self.step_count, cfg.optim, cfg.trainer.steps))
        self.optimizer.zero_grad(set_to_none=True)
        n, total = len(micro), None
        for mb in micro:
            with self.loss_context():
                loss = self.model(mb.inputs, mb.targets)
                (loss / n).backward()
            value = loss.detach()
            value = value.full_tensor() if isinstance(value, DTensor) else value
            total = value if total is None else total + value
        if cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, cfg.optim.grad_clip, foreach=True)
        self.optimizer.step()
        assert total is not None  # a step has micro-batches
        loss = total / n
        self.dist.all_reduce(loss)  # the ranks splitting samples hold different losses; the others copies
        self.step_count += 1
        self.last_loss = float(loss) / self.dist.get_world_size()
