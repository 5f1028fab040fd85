"""``hpctrain-train`` (also ``python -m hpctrain``): the Hydra app under any launcher.

Under MPI only rank 0 runs Hydra: it composes and resolves the config, makes
the one run directory, and broadcasts both; every other rank waits for that
broadcast and uses exactly rank 0's config (no per-rank composition, no
per-rank timestamped directories). With ``--multirun`` rank 0 broadcasts
each job of the sweep in turn and all ranks run it. Any composition error on
rank 0 is broadcast as a stop, so no rank hangs.

Errors: a ConfigError (bad layout, batch, preset, data path) prints one line
per problem on rank 0 and every rank exits with status 2. So does a
composition error (a value of the wrong type, an unknown key or preset, an
override that does not parse): Hydra is run with ``HYDRA_FULL_ERROR=1`` so
that it raises instead of printing its own seven lines, and
``hpctrain.config.explain`` turns the exception into one line. Any other
exception prints its traceback with the rank and aborts the MPI job, so a
failure on one rank never leaves the others waiting in a collective.

``hpctrain-train --plugins`` lists the loaded plugins and what they provide;
``--help`` the presets per group and the other commands (``hpctrain.help``).
``hpctrain-train ... --dry-run --world N [--ranks R1,R2]`` plays ranks of an
N-rank job in this one process (``hpctrain.dry_run``); its flags are checked,
and a launch of several ranks refused, before MPI starts.
"""
from __future__ import annotations

import os
import sys
import traceback
from typing import Any, List, Optional

from hpctrain.errors import HpctrainError, launcher_rank, write_error
from hpctrain.log import log_rank0
from hpctrain.sweep import record_sweep_point

_STOP = "stop"
_RUN = "run"
_FULL_ERROR = "HYDRA_FULL_ERROR"


def _print_plugins() -> int:
    from hpctrain.plugins import (  # omegaconf and pluggy: not needed for --help or a bad flag
        DISABLE_ENV,
        blocked_names,
        describe,
        get_manager,
    )

    pm = get_manager()
    rows = describe(pm)
    width = max([len(r.name) for r in rows] + [6])
    print(f"{'plugin':<{width}}  {'distribution':<24} {'version':<9} provides")
    for r in rows:
        caps = "; ".join(f"{k}: {', '.join(v)}" for k, v in sorted(r.capabilities.items())) or "-"
        print(f"{r.name:<{width}}  {r.distribution:<24} {r.version:<9} {caps}")
    if blocked_names():
        print(f"blocked by {DISABLE_ENV}: {', '.join(blocked_names())}")
    return 0


def _fail(message: str, rank: int, code: int, prefix: str = "error") -> int:
    if rank == 0:
        write_error(message, prefix)
    return code


def crash(rt) -> int:
    """An unexpected exception on this rank: its traceback, each line marked
    with the rank, then MPI_Abort, so no other rank waits in a collective."""
    tb = traceback.format_exc()
    sys.stderr.write("".join(f"[rank {rt.world_rank}] {line}\n" for line in tb.rstrip().splitlines()))
    sys.stderr.flush()
    if rt.world_size > 1:
        rt.mpi_comm.Abort(1)
    return 1


def _execute(cfg_yaml: str, run_dir: str, evaluate: bool = False, dry: Any = None) -> int:
    """Run one job on this rank from rank 0's resolved config (``evaluate``: hpctrain-eval's one validation;
    ``dry``: the ``--dry-run`` flags, ``hpctrain.dry_run``)."""
    from hpctrain.bootstrap import get_runtime  # heavy (torch): keeps --help and a bad flag fast
    from hpctrain.config.store import to_config  # heavy (torch): keeps --help and a bad flag fast
    from hpctrain.plugins import get_manager  # omegaconf and pluggy: not needed for --help or a bad flag
    from hpctrain.run import run  # heavy (torch): keeps --help and a bad flag fast
    from hpctrain.train.watchdog import JobStopped  # heavy (torch): keeps --help and a bad flag fast

    rt = get_runtime()
    try:
        cfg = to_config(cfg_yaml, get_manager())
        if dry is not None:
            from hpctrain.dry_run import execute  # heavy (the trainer): only for --dry-run

            print(execute(cfg, dry, get_manager()), flush=True)
            return 0
        run(cfg, run_dir, evaluate_only=evaluate)
        return 0
    except JobStopped as e:
        return e.exit_code  # the watchdog's line (rank 0 or 1) already says why
    except HpctrainError as e:
        # Raised identically on every rank (validation is agreed over MPI;
        # a diverged run sees the same global loss everywhere).
        code = _fail(str(e), rt.world_rank, e.exit_code, e.prefix)
        if e.on_every_rank and rt.world_size > 1:
            rt.mpi_comm.Barrier()  # rank 0 has written its line before any rank exits
        return code
    except Exception:  # noqa: BLE001 - any other failure: a traceback and an MPI abort, never a hang
        return crash(rt)


def _hydra_main(argv: List[str], world, evaluate: bool = False, dry: Any = None) -> int:
    """Rank 0 (or the only rank): run the Hydra app; broadcast each job."""
    import hydra  # heavy (hydra): keeps --help and a bad flag fast
    from hydra.core.hydra_config import HydraConfig  # heavy (hydra): keeps --help and a bad flag fast
    from hydra.types import RunMode  # heavy (hydra): keeps --help and a bad flag fast
    from omegaconf import OmegaConf  # omegaconf: not needed for --help or a bad flag
    from omegaconf.errors import OmegaConfBaseException  # omegaconf: not needed for --help or a bad flag

    from hpctrain.config.store import (  # heavy (torch): keeps --help and a bad flag fast
        CONF_DIR,
        expand_shorthands,
        register_configs,
    )
    from hpctrain.plugins import get_manager  # omegaconf and pluggy: not needed for --help or a bad flag

    try:
        register_configs(get_manager())
    except HpctrainError as e:  # a plugin's presets (two plugins storing one): its one line
        return _fail(str(e), 0, e.exit_code)
    codes: List[int] = []
    swept = _swept_keys(argv)
    user_full_error = os.environ.get(_FULL_ERROR)

    def task(cfg) -> int:
        # Runs on rank 0 of this process's world, or, under hydra/launcher=slurm,
        # on every rank of the sweep point's own Slurm job (world is then None).
        from hpctrain.bootstrap import get_runtime  # heavy (torch): keeps --help and a bad flag fast
        from hpctrain.checkpoint import (
            default_checkpoint_dir,  # omegaconf and pluggy: not needed for --help or a bad flag
        )

        run_dir = HydraConfig.get().runtime.output_dir
        if cfg.model.hf_dir:  # the shape from the directory's config.json (validation reports its problems)
            from hpctrain.hf.config import apply_hf_config

            explicit = [o.lstrip("+").split("=", 1)[0] for o in HydraConfig.get().overrides.task]
            if not apply_hf_config(cfg, explicit):
                log_rank0("model.hf_dir=%s: %s, %d layers, d_model %d", cfg.model.hf_dir, cfg.model.name,
                          cfg.model.n_layers, cfg.model.d_model)
        if str(cfg.model.vocab_size) == "auto":  # the data tokenizer's vocabulary (validation says when unknown)
            from hpctrain.data.sources import data_vocab_size

            vocab = data_vocab_size(cfg.data)
            if vocab is not None:
                cfg.model.vocab_size = int(vocab)
                log_rank0("model.vocab_size=auto: %d, the data tokenizer's vocabulary", int(vocab))
        if cfg.checkpoint.dir is None and (cfg.checkpoint.every or cfg.checkpoint.resume
                                           or cfg.checkpoint.save_on_stop):
            # one directory per experiment, found again by a relaunch (README, "Checkpoints");
            # created only when something is saved (a stop saves by default)
            cfg.checkpoint.dir = default_checkpoint_dir(cfg, HydraConfig.get().runtime.cwd)
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            _sweep_logging(cfg, HydraConfig.get(), swept)
        try:
            cfg_yaml = OmegaConf.to_yaml(cfg, resolve=True)
        except OmegaConfBaseException as e:  # e.g. an interpolation that does not resolve: one line, status 2
            code = _composition_failed(e, user_full_error == "1")
            codes.append(code)
            if HydraConfig.get().mode == RunMode.MULTIRUN:
                return code
            raise SystemExit(code) from None
        if get_runtime().world_rank == 0:
            _write_resolved(run_dir, cfg_yaml)
        if world is not None:
            _announce(world, (_RUN, cfg_yaml, run_dir))
        code = _execute(cfg_yaml, run_dir, evaluate, dry)
        codes.append(code)
        hc = HydraConfig.get()
        if hc.mode == RunMode.MULTIRUN and get_runtime().world_rank == 0:
            record_sweep_point(hc.sweep.dir, run_dir, hc.overrides.task, code)
        if code and HydraConfig.get().mode != RunMode.MULTIRUN:
            raise SystemExit(code)
        return code

    prog = "hpctrain-eval" if evaluate else "hpctrain-train"
    complaint = _bad_flags(expand_shorthands(argv))
    if complaint is not None:
        return _fail(f"{prog}: {complaint} (see {prog} --help)", 0, 2)
    app = hydra.main(config_path=CONF_DIR, config_name="train", version_base="1.3")(task)
    saved = sys.argv
    sys.argv = [saved[0] if saved else prog] + expand_shorthands(argv)
    os.environ[_FULL_ERROR] = "1"  # Hydra raises composition errors to us instead of printing seven lines
    try:
        app()
        code = max(codes, default=0)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception as e:  # noqa: BLE001 - reported as a composition error
        code = _composition_failed(e, user_full_error == "1")
    finally:
        sys.argv = saved
        if user_full_error is None:
            os.environ.pop(_FULL_ERROR, None)
        else:
            os.environ[_FULL_ERROR] = user_full_error
    return code


def _write_resolved(run_dir: str, cfg_yaml: str) -> None:
    """The config every rank runs, beside Hydra's (``store.RESOLVED_FILE``: what the report,
    ``hpctrain-plan --compare`` and a person reading the run should see)."""
    from hpctrain.config.store import RESOLVED_FILE  # heavy (torch): keeps --help and a bad flag fast

    try:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, RESOLVED_FILE), "w") as f:
            f.write(cfg_yaml)
    except OSError as e:  # the run itself reports an unwritable run directory; this file is a record
        from hpctrain.log import get_logger

        get_logger(__name__).warning("could not write %s in %s: %s", RESOLVED_FILE, run_dir, e)


def _bad_flags(args: List[str]) -> Optional[str]:
    """What Hydra's command-line parser would say about ``args`` (an unknown
    ``--flag``, a bad ``--cfg`` choice), or None: said as our one line instead
    of Hydra's usage block. Its parser is Hydra's internal one; without it
    Hydra says it itself."""
    if "--version" in args:  # Hydra prints its version and exits: its own business
        return None
    try:
        from hydra._internal.utils import get_args_parser  # heavy (hydra): keeps --help and a bad flag fast
    except ImportError:
        return None
    parser = get_args_parser()
    complaints: List[str] = []

    def error(message: str):
        complaints.append(message)
        raise SystemExit(2)

    parser.error = error  # type: ignore[method-assign]
    try:
        parser.parse_args(args)
    except SystemExit:
        pass
    return complaints[0] if complaints else None


def _swept_keys(argv: List[str]) -> List[str]:
    """The keys a ``--multirun`` command line sweeps (``optim.lr=1e-3,3e-3``: optim.lr)."""
    from hydra.core.override_parser.overrides_parser import (
        OverridesParser,  # heavy (hydra): keeps --help and a bad flag fast
    )

    try:
        parsed = OverridesParser.create().parse_overrides([a for a in argv if not a.startswith("-")])
    except Exception:  # noqa: BLE001 - Hydra reports a bad override itself, in one line (explain)
        return []
    return [o.key_or_group for o in parsed if o.is_sweep_override()]


def _sweep_logging(cfg, hc, swept: List[str]) -> None:
    """A sweep point is a run of its own in every logger backend, named by its
    number and swept values, grouped by the sweep (``logging.{dir,group,name}``
    left unset; ``hpctrain.train.loggers``)."""
    if cfg.logging.dir is None:
        cfg.logging.dir = hc.sweep.dir
    if cfg.logging.group is None:
        cfg.logging.group = hc.sweep.dir
    if cfg.logging.name is None:
        values = [o for o in hc.overrides.task if o.split("=", 1)[0].lstrip("+~") in swept]
        cfg.logging.name = " ".join([str(hc.job.num)] + values)


def _composition_failed(e: Exception, full_error: bool) -> int:
    """Rank 0's verdict on an exception out of Hydra (composing, parsing an
    override, resolving the config): a configuration problem is one
    ``hpctrain: error:`` line and status 2 (broadcast to every rank by
    ``main``); anything else keeps its traceback (status 1). With
    ``HYDRA_FULL_ERROR=1`` set by the user the traceback comes first."""
    from hpctrain.config.store import explain_error as explain  # heavy (torch): keeps --help and a bad flag fast
    from hpctrain.plugins import get_manager  # omegaconf and pluggy: not needed for --help or a bad flag

    try:
        message = explain(e, get_manager())
    except Exception:  # noqa: BLE001 - explaining must never hide the original error
        message = None
    if full_error or message is None:
        traceback.print_exc()
    return 1 if message is None else _fail(message, 0, 2)


def _announce(world, message):
    """Rank 0's ``message`` (a job or the stop) on every rank of ``world``. The other
    ranks wait for it in a non-blocking barrier polled with sleeps
    (``bootstrap.idle_wait``), not in the broadcast: they wait while rank 0 composes
    the config (about a second), and a blocking broadcast polls busily, taking the
    core from rank 0 where ranks share cores (tests, a laptop, oversubscribed nodes)."""
    from hpctrain.bootstrap import idle_wait  # heavy (torch): keeps --help and a bad flag fast

    idle_wait(world, poll_s=0.002)
    return world.bcast(message, root=0)


def main(argv: Optional[List[str]] = None, evaluate: bool = False) -> int:
    """``hpctrain-train`` (or with ``evaluate``, ``hpctrain-eval``) on this process; its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:  # every plugin loaded and its config sections checked: a broken one is one line, before MPI starts
        from hpctrain.config.store import build_schema  # heavy (torch): keeps --help and a bad flag fast
        from hpctrain.plugins import get_manager  # omegaconf and pluggy: not needed for --help or a bad flag

        build_schema(get_manager())
    except HpctrainError as e:
        return _fail(str(e), launcher_rank(), e.exit_code)
    if "--plugins" in argv:
        return _print_plugins()
    if "--help" in argv or "-h" in argv:
        from hpctrain.config.store import CONF_DIR  # heavy (torch): keeps --help and a bad flag fast
        from hpctrain.help import help_text

        print(help_text(CONF_DIR, "hpctrain-eval" if evaluate else "hpctrain-train"))
        return 0
    dry = None
    if any(a == "--dry-run" or a.split("=", 1)[0] in ("--world", "--ranks") for a in argv):
        from hpctrain.dry_run import check_launch, split_flags  # heavy (torch): only for --dry-run

        try:
            argv, dry = split_flags(argv)
            check_launch(dry, evaluate)  # before MPI starts: no collective
        except HpctrainError as e:
            return _fail(str(e), launcher_rank(), e.exit_code)
    from hpctrain.bootstrap import init_runtime, shutdown  # heavy (torch): keeps --help and a bad flag fast

    try:
        rt = init_runtime()
    except HpctrainError as e:
        return _fail(str(e), 0, 2)
    if dry is not None and rt.world_size > 1:  # a launcher the environment check missed: no collective yet
        try:
            check_launch(dry, evaluate, rt.world_size)
        except HpctrainError as e:
            return _fail(str(e), rt.world_rank, e.exit_code)
    world = rt.mpi_comm if rt.world_size > 1 else None
    try:
        if rt.is_main:
            code = 1
            try:
                code = _hydra_main(argv, world, evaluate, dry)
            finally:
                if world is not None:
                    _announce(world, (_STOP, code, None))
        else:
            assert world is not None  # ranks other than 0 exist only in a world of several
            code = 0
            while True:
                kind, payload, run_dir = _announce(world, None)
                if kind == _STOP:
                    code = max(code, payload)  # a composition error on rank 0 fails every rank
                    break
                code = max(code, _execute(payload, run_dir, evaluate))
    finally:
        shutdown()
    return code


def entry() -> None:
    sys.exit(main())


def entry_eval() -> None:
    """``hpctrain-eval <overrides>``: the same app, launched the same way, but
    it loads ``checkpoint.resume`` at the layout given and runs one validation
    (``data.split`` or ``data.validation.paths``) instead of training."""
    sys.exit(main(evaluate=True))


if __name__ == "__main__":
    entry()
