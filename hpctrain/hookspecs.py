"""Hook specifications: what a plugin may provide (specs only).

A plugin is a module (or object) with functions named like these, decorated
with ``hpctrain.hookimpl``, registered under the ``hpctrain`` entry-point
group. ``firstresult`` hooks stop at the first non-None answer: return None to
decline (e.g. a backend plugin asked for a backend name it does not serve).

Call order in a run: register_configs / config_sections (before composition)
-> validate (every rank, before any collective) -> make_backend (per group)
-> make_module (while the model is built on the meta device) -> parallelize
(per axis, in the order tp, cp, ep, pp, dp; only the plugin chosen for the
axis answers, with a handle: ``hpctrain.parallel``) -> weight_source
(``checkpoint.init_from``) -> make_optimizer -> make_checkpointer ->
make_logger (rank 0) -> on_train_start -> [after_finalize_grads /
after_optimizer_step / step_metrics / on_step_end, on_checkpoint]* ->
on_train_end. capabilities is asked whenever a name is looked up, and
benchmarks by ``hpctrain-bench`` only.

What happens between the hooks (the axes' order, the gradients' reduction,
the optimizer and the step schedule) is the core's, written once in
``hpctrain.parallel.compose`` and ``hpctrain.parallel.finalize``; an axis
plugin takes part through the methods of the handle it returns.

Lifecycle hooks (``on_train_start`` ... ``on_train_end``) receive the run's
``TrainState`` (``hpctrain.train.state``: config, mesh, model, optimizer,
cursor, handles, run directory, step), never the trainer, and read it only;
a plugin's per-run state lives in its axis handle.

Hook implementations may accept any subset of a spec's arguments (pluggy),
so arguments added to a spec later do not break existing plugins.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from omegaconf import DictConfig

    from hpctrain.checkpoint import Checkpointer
    from hpctrain.comm.protocol import Communicator
    from hpctrain.mesh import Group, Mesh
    from hpctrain.parallel.handles import AxisHandle
    from hpctrain.train.state import TrainState

PROJECT = "hpctrain"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def hpctrain_capabilities() -> Dict[str, List[str]]:
    """Names this plugin serves, by kind, for listings and error messages.

    Kinds used by the core: ``comm.backend``, ``parallel`` (axes it
    parallelises), ``model.attention``, ``model.ffn``, ``checkpoint.format``,
    ``pipeline.schedule``, ``optim``, ``observer``, ``logging.backend``. Example:
    ``{"comm.backend": ["torch", "gloo", "nccl"]}``.
    """


@hookspec
def hpctrain_config_sections() -> Dict[str, type]:
    """Typed config sections this plugin adds: ``{"dotted.key": Dataclass}``.

    ``{"example_metrics": ExampleConfig}`` adds a top-level section;
    ``{"parallel.zero": ZeroConfig}`` nests one under ``parallel``. Every
    field needs a default; overrides are type-checked like core keys.
    """


@hookspec
def hpctrain_register_configs(config_store: Any) -> None:
    """Add group options (presets) to Hydra's ConfigStore, e.g.
    ``config_store.store(group="comm", name="mpi", node={"backend": "mpi"})``."""


@hookspec
def hpctrain_validate(cfg: "DictConfig", world_size: int, run_dir: Optional[str]) -> Optional[List[str]]:
    """Return problems with ``cfg`` as clear one-line messages naming the fix.

    Runs on every rank before any collective, so it must be a pure function of
    ``cfg``, ``world_size`` and ``run_dir`` (the run's directory, None when the
    run has none) and the local filesystem.
    """


@hookspec(firstresult=True)
def hpctrain_make_backend(name: str, group: "Group", cfg: "DictConfig") -> Optional["Communicator"]:
    """Return a Communicator for ``group`` if this plugin serves backend ``name``.

    Called on every rank, for every axis group, in the same order: creating a
    group may be collective over the world.
    """


@hookspec(firstresult=True)
def hpctrain_make_module(kind: str, name: str, cfg: "DictConfig", layer_index: int,
                         mesh: Optional["Mesh"]) -> Optional["torch.nn.Module"]:
    """Build a replaceable model part (``kind`` in ``attention``, ``ffn``)
    named ``name`` for block ``layer_index``, on the meta device, with a
    ShardSpec on every parameter. ``mesh`` is the run's layout (None when the
    model is built without one, e.g. by tools). Return None to decline."""


@hookspec(firstresult=True)
def hpctrain_parallelize(model: "torch.nn.Module", axis: str, mesh: "Mesh",
                         cfg: "DictConfig", run_dir: Optional[str]) -> Optional["AxisHandle"]:
    """Apply the transform of mesh axis ``axis`` to the meta-device model and
    return a handle (``hpctrain.parallel.handles``) whose ``model`` is what
    this rank runs afterwards (the same model changed in place, or a
    pipeline stage). Update the ShardSpec of every parameter split. Only the
    plugin chosen for the axis is asked, and only for an axis it serves
    (its capabilities' ``parallel`` list): a plugin serving one axis need
    not check ``axis``. ``run_dir`` is the run's directory (None without
    one), for files the implementation writes.

    Axis ``dp`` stands for the data axes (asked whenever ``cp x ep x dp`` >
    1: ``ep`` and ``cp`` ranks are data-parallel for every weight not split
    on them) and returns a ``DataHandle`` (gradient reduction, optimizer);
    ``pp`` returns a ``PipelineHandle`` (the step schedule). Only the plugin
    chosen for the axis is asked: ``parallel.impl.<axis>`` names it (an
    entry-point name), or the one installed plugin whose capabilities list
    the axis under ``parallel`` (``hpctrain_claim_axis`` breaks ties). Keep
    per-run state in the handle, never on the model; read only the core's
    config keys and your own section."""


@hookspec
def hpctrain_claim_axis(axis: str, cfg: "DictConfig") -> Optional[bool]:
    """Whether this plugin wants to implement ``axis`` (one it serves) for
    this config: True (chosen over plugins without an opinion, e.g. a ZeRO
    plugin when ``parallel.zero.stage > 0``), False (not for this config),
    None (no opinion). Asked only of plugins serving ``axis``.
    ``parallel.impl.<axis>`` overrides every claim; two True claims without
    it are an error naming both. Pure function of cfg."""


@hookspec(firstresult=True)
def hpctrain_make_optimizer(params: List["torch.nn.Parameter"], model: "torch.nn.Module", mesh: "Mesh",
                            cfg: "DictConfig") -> Optional["torch.optim.Optimizer"]:
    """Return the optimizer of ``params`` (the trainable parameters of
    ``model``, this rank's part), or None for the core's AdamW. Asked only
    when the data axes' handle keeps no sharded optimizer state of its own
    (ZeRO's ``make_optimizer`` comes first).

    For checkpointing, ``optimizer.state`` maps each parameter to its state;
    a state tensor not shaped like its parameter needs
    ``optimizer.state_spec(param, key)`` (``hpctrain.checkpoint``)."""


@hookspec(firstresult=True)
def hpctrain_make_checkpointer(name: str, mesh: Optional["Mesh"], cfg: "DictConfig",
                               run_dir: Optional[str]) -> Optional["Checkpointer"]:
    """Return a checkpointer for format ``name`` or None (``hpctrain.checkpoint``:
    it saves and loads a ``TrainState``). ``mesh`` is the run's layout (None
    outside a run, e.g. the checkpoint benchmark); ``run_dir`` the run's
    directory (None without one)."""


@hookspec(firstresult=True)
def hpctrain_weight_source(path: str, cfg: "DictConfig") -> Optional[Any]:
    """``checkpoint.init_from=path`` (weights only) when ``path`` is a checkpoint of your format: return a
    reader with ``where(logical_name)`` (None when it has no such tensor) and ``box(logical_name, box)``
    (the values of that box of the logical tensor, any float dtype), read lazily: each rank asks only
    for the boxes it holds. None declines."""


@hookspec(firstresult=True)
def hpctrain_make_logger(name: str, cfg: "DictConfig", run_dir: str) -> Optional[Any]:
    """Return a metrics logger for backend ``name`` (an entry of ``logging.backends``) or None.

    Called on rank 0 only, before step 1; raise (a missing package, a
    directory that cannot be written) and the run stops there with one
    ``hpctrain: error:`` line. The logger has ``log(step, metrics)``
    (``metrics``: the step's numbers by name, finite floats), ``flush()``
    and ``close()`` (``hpctrain.train.loggers.MetricLogger``). Where to write:
    ``hpctrain.train.loggers.logging_dir(cfg, run_dir)``; the run's group and
    name: ``run_group`` and ``run_name``. List the name under
    ``logging.backend`` in ``hpctrain_capabilities``."""


@hookspec
def hpctrain_after_finalize_grads(state: "TrainState", step: int) -> None:
    """Observer: the gradients of optimizer step ``step`` (1-based) are final
    (``hpctrain.parallel.finalize``: reduced over the data axes, tied
    embeddings summed; with fp16, divided by the loss scale again) and not
    yet clipped; the optimizer has not stepped. Every rank, same order."""


@hookspec
def hpctrain_after_optimizer_step(state: "TrainState", step: int) -> None:
    """After optimizer step ``step`` (1-based) updated the weights. Called on
    every rank in the same order, so it may use collectives (every rank must
    then enter them); skipped, on every rank, for a step whose update was
    skipped. (An axis implementation updates what it owns, e.g. MoE's router
    biases, in its handle's ``after_step`` instead.)"""


@hookspec
def hpctrain_step_metrics(state: "TrainState", step: int, metrics: Dict[str, float]) -> Optional[Dict[str, float]]:
    """Add metrics of optimizer step ``step`` (1-based) before they are
    logged and written to ``metrics.jsonl``: return ``{name: value}``
    (e.g. ``{"mine.tokens_seen": 1e6}``; prefix names with your plugin's).

    Called on every rank in the same order, so a plugin may reduce its
    values with a collective here (every rank must then enter it, holding
    something to report or not). ``metrics`` holds the core's values and
    the axis handles' so far; a name that is already there is an error."""


@hookspec
def hpctrain_benchmarks() -> Dict[str, str]:
    """Benchmarks this plugin offers to ``hpctrain-bench``: ``{name: module}``,
    each module (imported when run or listed) with ``main(argv) -> int`` and a
    one-line docstring. A benchmark that needs a plugin's internals (its
    layouts, its layer) lives in that plugin and is reached this way."""


@hookspec
def hpctrain_on_train_start(state: "TrainState") -> None:
    """Observer: the model, optimizer and data are ready (``state.step`` is
    the step resumed from, 0 on a fresh start)."""


@hookspec
def hpctrain_on_step_end(state: "TrainState", step: int, metrics: Dict[str, float]) -> None:
    """Observer: optimizer step ``step`` (1-based) finished with ``metrics``."""


@hookspec
def hpctrain_on_checkpoint(state: "TrainState", step: int, path: str) -> None:
    """Observer: the checkpoint of step ``step`` was saved at ``path`` (with
    an async save, its commit may still be running)."""


@hookspec
def hpctrain_on_train_end(state: "TrainState", metrics: Dict[str, float]) -> None:
    """Observer: training finished (``metrics`` of the last step)."""
