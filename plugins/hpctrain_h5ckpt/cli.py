"""``hpctrain-ckpt``: inspect, verify and export hpctrain HDF5 checkpoints.

    hpctrain-ckpt inspect PATH [--config]     tree, shapes, step, layout, size
    hpctrain-ckpt verify PATH                 every checksum and finite values; a directory: every
                                              checkpoint in it; exit 1 if any is bad
    hpctrain-ckpt export PATH --to DIR [--dtype bfloat16] [--max-shard-size 5GB] [--tokenizer FILE|DIR]
                  [--overwrite]               a Hugging Face model directory (Llama or Mixtral) that
                                              transformers' from_pretrained loads; a DIR holding files
                                              only with --overwrite, which replaces it whole, atomically;
                                              a LoRA run's (finetune=lora) with --merge: adapters merged
    hpctrain-ckpt export PATH --adapter DIR   a LoRA run's adapters as a PEFT adapter directory, which
                                              peft.PeftModel.from_pretrained loads onto the base model
    hpctrain-ckpt import-hf DIR OUT.h5        a Hugging Face directory as one of our checkpoints (step 0)

PATH is a checkpoint file or a checkpoint directory (inspect and export:
its newest committed checkpoint; verify: every one, and the orphaned
temporary files and a stale ``latest`` are named). One
process, the default HDF5 driver, read-only; nothing is ever unpickled.
Exit status: 0 fine, 1 corrupt or unreadable, 2 bad usage (one ``hpctrain: error:`` line: a PATH that
does not exist, an export target whose parent does not exist or that holds files without ``--overwrite``,
an export ``--tokenizer`` that does not exist or has more tokens than the model's vocabulary, a Hugging
Face directory that cannot be imported). An export is written into a new directory beside ``--to`` and
renamed into place at the end (with ``--overwrite``, swapped with the old directory in one step, which
is then removed): a failed export leaves ``--to`` as it was, and no file of an older model stays beside
the new one.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
from typing import Any, List, Optional

from hpctrain.errors import ArgumentParser, ConfigError, write_error
from hpctrain.provenance import ATTR as PROVENANCE_ATTR
from hpctrain.provenance import lines as provenance_lines
from hpctrain.provenance import parse as parse_provenance

from hpctrain_h5ckpt import store
from hpctrain_h5ckpt.errors import CheckpointError
from hpctrain_h5ckpt.options import IOOptions


def _resolve(path: str) -> str:
    if os.path.isdir(path):
        found = store.candidates(path)
        if not found:
            raise CheckpointError(f"{path}: no committed checkpoint (step_*.h5) in this directory")
        return found[0]
    if not os.path.exists(path):  # a mistyped path: bad usage (2), not a bad checkpoint (1)
        raise ConfigError(f"{path}: no such file or directory; give a checkpoint file (step_*.h5) or the "
                          "checkpoint.dir holding them")
    return path


def _reader(path: str) -> Any:
    from mpi4py import MPI  # MPI starts at import: only for a command that reads

    from hpctrain_h5ckpt.reader import CheckpointReader  # h5py: keeps --help and a bad flag fast

    opts = IOOptions(parallel=False, collective_min_bytes=0, alignment=0, fsync=False, verify=True)
    return CheckpointReader(path, MPI.COMM_SELF, opts)


def _mb(n: float) -> str:
    return f"{n / 1e6:,.2f} MB"


def cmd_inspect(args: argparse.Namespace) -> int:
    path = _resolve(args.path)
    with _reader(path) as r:
        m = r.meta
        size = os.path.getsize(path)
        print(f"checkpoint  {path}")
        print(f"format      {m.get('format')} v{m.get('format_version')}   file size {_mb(size)}")
        print(f"step        {m.get('step')}   consumed samples {m.get('consumed_samples')}   model {m.get('model')}")
        layout = json.loads(m.get("layout", "{}"))
        sizes = layout.get("sizes", {})
        order = layout.get("order", "").split("-") if layout.get("order") else sorted(sizes)
        print(f"layout      {' * '.join(f'{a}={sizes[a]}' for a in order if a in sizes)}  "
              f"({layout.get('world_size')} ranks, order {layout.get('order')})")
        print(f"scheduler   {m.get('scheduler')}")
        print(f"versions    {m.get('versions')}")
        record = parse_provenance(m.get(PROVENANCE_ATTR))
        for line in provenance_lines(record) if record else ["provenance  (not recorded: saved before hpctrain "
                                                             "recorded it)"]:
            print(line)
        rows = [(p, d) for p, d in sorted(r.index.items())]
        width = max(len(p) for p, _ in rows)
        print(f"\n{'dataset':<{width}}  {'shape':<14} {'dtype':<9} {'size':>12}  splits")
        params = tensor_bytes = 0
        for p, d in rows:
            shape = "x".join(map(str, d.shape)) or "scalar"
            dtype = d.attrs.get("torch_dtype", d.dtype)
            print(f"{p:<{width}}  {shape:<14} {str(dtype):<9} {_mb(d.nbytes):>12}  {d.attrs.get('splits', '')}")
            if p.startswith("/model/"):
                params += int(math.prod(d.shape))
            if p.startswith(("/model/", "/optim/")):
                tensor_bytes += d.nbytes
        print(f"\n{len(rows)} datasets, {params:,} parameters, {_mb(tensor_bytes)} of model+optimizer tensors, "
              f"file {_mb(size)} = {size / max(params, 1):.2f} bytes/parameter")
        if args.config:
            text = r.file["meta/config"][()]
            print("\n" + (text.decode("utf-8") if isinstance(text, bytes) else str(text)))
    return 0


def _verify_one(path: str, report_errors: bool = False) -> bool:
    """Every dataset's checksum, and finite weights and optimizer state; one
    line either way (a corrupt file raises, unless ``report_errors``)."""
    from hpctrain_h5ckpt.finite import all_finite  # heavy (torch): only for verify
    from hpctrain_h5ckpt.snapshot import from_numpy  # heavy (torch): only for verify

    def finite(r: Any, name: str) -> bool:
        return all_finite(from_numpy(r.file[name][()], r.index[name].attrs.get("torch_dtype", "")))  # bf16: bits

    try:
        with _reader(path) as r:
            r.read({})  # nothing wanted: every dataset is read whole and checked
            total = sum(d.nbytes for d in r.index.values())
            bad = [p for p in sorted(r.index) if p.startswith(("/model/", "/optim/")) and not finite(r, p)]
            step = r.meta.get("step")
    except CheckpointError as e:
        if not report_errors:
            raise
        print(f"BAD {path}: {e}")
        return False
    if bad:
        print(f"BAD {path}: non-finite values (NaN or inf) in {len(bad)} tensor(s): {', '.join(bad[:5])}"
              + (", ..." if len(bad) > 5 else ""))
        return False
    print(f"OK {path}: {len(r.index)} datasets, {_mb(total)} verified (step {step})")
    return True


def cmd_verify(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.path):
        return 0 if _verify_one(_resolve(args.path)) else 1
    found = store.committed(args.path)
    if not found:
        raise CheckpointError(f"{args.path}: no committed checkpoint (step_*.h5) in this directory")
    ok = [_verify_one(p, report_errors=True) for p in found]
    latest = store.read_latest(args.path)
    if latest and os.path.abspath(latest) != os.path.abspath(found[0]):
        print(f"note: 'latest' names {os.path.basename(latest)}, older than {os.path.basename(found[0])}; "
              "resume=auto takes the newest good one")
    for orphan in store.orphans(args.path):
        print(f"note: {orphan} is left from a save that did not finish (the next run removes it)")
    print(f"{sum(ok)} of {len(ok)} checkpoints OK")
    return 0 if all(ok) else 1


def cmd_export(args: argparse.Namespace) -> int:
    from hpctrain.hf.export import check_target, parse_size  # heavy (torch): only for export

    from hpctrain_h5ckpt.export import export_adapter, export_hf  # heavy (torch, h5py): only for export

    if (args.to is None) == (args.adapter is None):
        raise ConfigError("hpctrain-ckpt export: give --to DIR (a Hugging Face model) or --adapter DIR (a LoRA "
                          "run's adapters in the PEFT format), one of them")
    if args.adapter is not None:
        if args.merge:
            raise ConfigError("hpctrain-ckpt export: --merge goes with --to (the merged model), not --adapter")
        check_target(args.adapter, args.overwrite)
        files = export_adapter(_resolve(args.path), args.adapter, args.overwrite)
        print(f"wrote {args.adapter}: {', '.join(files)} (PEFT LoRA adapter; q/k rows in rotate_half order)")
        return 0
    check_target(args.to, args.overwrite)  # before the checkpoint is even looked for
    path = _resolve(args.path)
    # written beside --to and renamed into place: a failure leaves no partial model and --to as it was
    files = export_hf(path, args.to, args.dtype, parse_size(args.max_shard_size), args.tokenizer, args.overwrite,
                      args.merge)
    print(f"wrote {args.to}: {', '.join(files)} (Hugging Face {args.dtype}; q/k rows in rotate_half order"
          f"{'; LoRA adapters merged' if args.merge else ''})")
    return 0


def cmd_import_hf(args: argparse.Namespace) -> int:
    from hpctrain_h5ckpt.import_hf import import_hf  # heavy (the whole trainer): only for import

    saved = import_hf(args.hf_dir, args.out)
    print(f"wrote {saved}: the weights of {args.hf_dir} as an hpctrain checkpoint (step 0); train from it with "
          f"checkpoint.init_from={saved} model=hf model.hf_dir={args.hf_dir}")
    return 0


def parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="hpctrain-ckpt", description="Inspect, verify and export hpctrain HDF5 checkpoints.")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="tree, shapes, step, layout, size")
    p.add_argument("path")
    p.add_argument("--config", action="store_true", help="also print the resolved config (YAML)")
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser("verify", help="check every dataset's checksum; exit 1 if anything is wrong")
    p.add_argument("path")
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser("export", help="a Hugging Face model directory (Llama or Mixtral) of the model weights")
    p.add_argument("path")
    p.add_argument("--to", default=None, help="output directory (made; its parent must exist)")
    p.add_argument("--adapter", default=None, metavar="DIR",
                   help="a LoRA run's adapters as a PEFT adapter directory (adapter_config.json, "
                        "adapter_model.safetensors) instead of --to")
    p.add_argument("--merge", action="store_true", help="with --to: a LoRA run's adapters merged into the model")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="dtype of the exported weights (default float32)")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (default 5GB, as transformers)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer file or directory to copy alongside (an imported model's come by themselves)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a --to directory that holds files (whole, atomically: nothing of it is kept)")
    p.set_defaults(func=cmd_export)
    p = sub.add_parser("import-hf", help="a Hugging Face directory (Llama, Mistral, Mixtral) as our checkpoint")
    p.add_argument("hf_dir")
    p.add_argument("out", help="the checkpoint file to write (.h5)")
    p.set_defaults(func=cmd_import_hf)
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    if argv is None and hasattr(signal, "SIGPIPE"):  # as a command: `hpctrain-ckpt inspect X | head` ends quietly
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    args = parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as e:  # bad usage: the one line every hpctrain command prints, status 2
        write_error(str(e))
        return 2
    except CheckpointError as e:
        write_error(str(e))
        return 1


if __name__ == "__main__":
    sys.exit(main())
