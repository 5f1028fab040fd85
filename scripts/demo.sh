#!/usr/bin/env bash
# The main job: set up (idempotent; ~6 minutes the first time, seconds after)
# and train the tiny GPT on the built-in corpus with 4 MPI ranks (data
# parallel). Extra arguments are Hydra overrides: bash scripts/demo.sh trainer.steps=100
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1   # harmless when not root
export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_mpi_yield_when_idle=1  # 4 ranks on fewer cores
MPIEXEC=$(command -v mpiexec.openmpi || command -v mpiexec)
exec "$MPIEXEC" -n "${HPCTRAIN_DEMO_RANKS:-4}" .venv/bin/hpctrain-train trainer.steps=40 "$@"
