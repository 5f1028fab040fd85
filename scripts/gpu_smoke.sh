#!/usr/bin/env bash
# GPU paths, on a machine with one CUDA GPU, Open MPI, torch, mpi4py and h5py
# (the device machines lent to some sessions; see docs/benchmarks.md). Runs a
# one-process reference and 2-rank runs sharing the GPU (NCCL refuses two
# ranks on one GPU, so the mpi and hier backends carry the tensors, staged
# through host memory), and prints each run's largest relative loss
# difference from the reference. Python packages the machine lacks
# (hydra-core, omegaconf, antlr4, a setuptools >= 77) are installed from
# wheels in ./.whl when present. Usage: bash scripts/gpu_smoke.sh [OUT_DIR]
set -u
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-/tmp/hpctrain-gpu}}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD:$PWD/plugins
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || tail -5 "$OUT/pip.log"
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
C="trainer.device=cuda trainer.steps=6 trainer.log_every=6 trainer.progress=off trainer.global_batch_size=8 trainer.micro_batch_size=2"
run() { name=$1; shift; timeout 240 "$@" $C hydra.run.dir="$OUT/$name" > "$OUT/$name.log" 2>&1; echo "$name rc=$?"; }
run one python3 -m hpctrain
run dp_mpi mpiexec -n 2 python3 -m hpctrain comm.backend=mpi
run z1_offload mpiexec -n 2 python3 -m hpctrain comm.backend=mpi parallel.zero.stage=1 parallel.zero.offload=cpu
run z2_bf16 mpiexec -n 2 python3 -m hpctrain comm.backend=hier parallel.zero.stage=2 parallel.zero.param_dtype=bf16
run z2_offload_ckpt mpiexec -n 2 python3 -m hpctrain comm.backend=mpi parallel.zero.stage=2 parallel.zero.offload=cpu checkpoint.every=3
run z3 mpiexec -n 2 python3 -m hpctrain comm.backend=mpi parallel.zero.stage=3
run z3_offload mpiexec -n 2 python3 -m hpctrain comm.backend=mpi parallel.zero.stage=3 parallel.zero.offload=cpu
run z3_bf16_offload mpiexec -n 2 python3 -m hpctrain comm.backend=hier parallel.zero.stage=3 parallel.zero.offload=cpu parallel.zero.param_dtype=bf16
OUT="$OUT" python3 - <<'PY'
import json, os
out = os.environ["OUT"]
def losses(n):
    p = f"{out}/{n}/metrics.jsonl"
    return [json.loads(l)["loss"] for l in open(p)] if os.path.exists(p) else None
ref = losses("one")
for n in ("dp_mpi", "z1_offload", "z2_bf16", "z2_offload_ckpt", "z3", "z3_offload", "z3_bf16_offload"):
    got = losses(n)
    print(f"{n:18s}", "NO METRICS (see its log)" if not got else
          "largest relative loss difference from one process: %.1e" % max(abs(a - b) / abs(b) for a, b in zip(got, ref)))
PY
