"""``hpctrain-train --help``: the presets a user can pick, per group, and where to go next.

Hydra's own help lists every entry of a group, the typed schemas
(``model_schema``...) included, which are not presets anyone should pick;
this page lists the real presets (the package's YAML files and the ones
plugins register) and points to the other commands and the docs.
``--hydra-help`` still shows Hydra's.
"""
from __future__ import annotations

from typing import Dict, List

DOCS = "README.md and docs/ in the source tree (layouts.md, planner.md, plugins.md, reliability.md, slurm.md)"


def preset_groups(config_dir: str) -> Dict[str, List[str]]:
    """{group: its presets}, schemas left out; groups with no preset are left out."""
    from hydra import initialize_config_dir  # heavy: keeps --help fast
    from hydra.core.global_hydra import GlobalHydra  # heavy: keeps --help fast

    from hpctrain.config.store import register_configs  # heavy: keeps --help fast
    from hpctrain.plugins import get_manager  # heavy: keeps --help fast

    register_configs(get_manager())
    GlobalHydra.instance().clear()
    out: Dict[str, List[str]] = {}
    with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        for group in sorted(g for g in loader.list_groups("") if g != "hydra"):
            presets = [o for o in loader.get_group_options(group) if not o.endswith("_schema")]
            if presets:
                out[group] = presets
    GlobalHydra.instance().clear()
    return out


EVAL = """Load a checkpoint at the layout given and report its validation loss (one pass, no training step);
rank 0 writes validation.json in the run directory. It needs the checkpoint, checkpoint.resume=<file> or
checkpoint.resume=auto with the run's checkpoint.dir, and the training run's validation data:
data=indexed with data.split=<fraction> or data.validation.paths=[<shards>]. It saves nothing and takes no
lock, so it can read the checkpoints of a run that is still training. e.g.
  mpirun -n 2 hpctrain-eval data=indexed data.paths=[data/corpus.json] model.vocab_size=auto data.split=0.01 \\
      checkpoint.resume=auto checkpoint.dir=ckpt/corpus"""


def help_text(config_dir: str, prog: str = "hpctrain-train") -> str:
    groups = preset_groups(config_dir)
    width = max(len(g) for g in groups)
    rows = "\n".join(f"  {g:<{width}}  {', '.join(p)}" for g, p in groups.items())
    commands = [
        (f"{prog} --plugins", "installed plugins and what each provides (backends, axes, loggers)"),
        (f"{prog} --hydra-help", "Hydra's own options (sweeps, launchers, output directories)"),
        ("hpctrain-train", "train with the same config and launcher"),
        ("hpctrain-prepare", "tokenize a corpus into indexed shards (data=indexed)"),
        ("hpctrain-eval", "the validation loss of a checkpoint, at any layout"),
        ("hpctrain-plan", "predict memory and step time of every layout and pick one"),
        ("hpctrain-tune", "measure the planner's best layouts here and keep the fastest"),
        ("hpctrain-parity", "check a layout: the same losses and gradients as one process"),
        ("hpctrain-ckpt", "inspect, verify and export checkpoints"),
        ("hpctrain-report RUN_DIR", "one HTML page of a run (or a sweep) directory"),
        ("hpctrain-bench", "hpctrain against its peers (DDP, DCP, ...) on this machine"),
        ("docs", DOCS),
    ]
    commands = [(c, what) for c, what in commands if c != prog]
    more = "\n".join(f"  {c:<28} {what}" for c, what in commands)
    dry = ("" if prog == "hpctrain-eval" else
           f"\n{prog} ... --dry-run --world N [--ranks R1,R2] plays ranks of an N-rank job in this one process: the\n"
           "bytes each holds and sends in a step, beside the planner's (docs/planner.md, \"Dry run\").")
    summary = (EVAL if prog == "hpctrain-eval" else
               "Train a transformer in one process or under mpirun/srun (every rank runs the same command).")
    return f"""usage: {prog} [group=preset ...] [key=value ...] [--multirun] [--cfg job] [--plugins]

{summary}

== Configuration groups ==
Pick one preset per group (group=preset), e.g. {prog} model=gpt2-124m parallel=3d

{rows}

Override any key (key=value), e.g. trainer.steps=100 optim.lr=1e-3 parallel.tp=2;
{prog} --cfg job prints the composed config with every key.{dry}

== More ==
{more}
"""
