"""``hpctrain-prepare``: tokenise a local text file into a ``.bin`` token file.

Byte-level tokens (vocab 256) stored as uint16 (default) or uint32, written
in chunks so files larger than memory work, plus the JSON sidecar the
training data loader reads (dtype, vocab size, token count).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from hpctrain.data.sources import TOKEN_DTYPES, sidecar_path

CHUNK = 1 << 24


def prepare(input_path: str, output_path: str, dtype: str = "uint16") -> int:
    if not os.path.isfile(input_path):
        raise FileNotFoundError(f"input text file {input_path} does not exist")
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(TOKEN_DTYPES)}")
    os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
    tmp = output_path + ".tmp"
    n = 0
    with open(input_path, "rb") as src, open(tmp, "wb") as dst:
        while chunk := src.read(CHUNK):
            arr = np.frombuffer(chunk, dtype=np.uint8).astype(TOKEN_DTYPES[dtype])
            arr.tofile(dst)
            n += arr.size
    os.replace(tmp, output_path)
    with open(sidecar_path(output_path), "w") as f:
        json.dump({"dtype": dtype, "vocab_size": 256, "num_tokens": n, "tokenizer": "bytes",
                   "source": os.path.abspath(input_path)}, f, indent=1)
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="hpctrain-prepare", description=__doc__.splitlines()[0])
    ap.add_argument("input", help="a local text file")
    ap.add_argument("output", help="the .bin token file to write (a .json sidecar goes next to it)")
    ap.add_argument("--dtype", default="uint16", choices=sorted(TOKEN_DTYPES))
    args = ap.parse_args(argv)
    try:
        n = prepare(args.input, args.output, args.dtype)
    except (OSError, ValueError) as e:
        sys.stderr.write(f"hpctrain-prepare: error: {e}\n")
        return 2
    sys.stdout.write(f"wrote {n} tokens ({args.dtype}) to {args.output}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
