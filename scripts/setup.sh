#!/usr/bin/env bash
# Idempotent set-up for a fresh Debian/Ubuntu machine (root or sudo):
#   bash scripts/setup.sh           what hpctrain and its demo need
#   bash scripts/setup.sh --tests   also what only the test suite needs (scripts/test.sh passes it)
#   1. Open MPI + parallel HDF5 from apt, when missing;
#   2. a virtual environment (.venv, or $HPCTRAIN_VENV);
#   3. h5py built against the MPI HDF5, kept in a wheelhouse outside the repo
#      keyed by MPI flavour and HDF5 version (pip's own cache ignores HDF5_MPI,
#      so a serial wheel could be reused silently);
#   4. torch pinned to the CPU wheel, then hpctrain with its test extras.
# On a cluster with environment modules, see README "Installing on a cluster".
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${HPCTRAIN_VENV:-$PWD/.venv}
PY=${PYTHON:-python3}
H5PY_VERSION=3.16.0
TORCH_SPEC=${HPCTRAIN_TORCH_SPEC:-torch==2.13.0}
say() { printf '[setup] %s\n' "$*"; }

export DEBIAN_FRONTEND=noninteractive
apt_pkgs=(openmpi-bin libopenmpi-dev libhdf5-openmpi-dev hdf5-tools gcc libc6-dev pkg-config)
# --tests (scripts/test.sh): also what only the tests need: chromium, the headless browser the report
# test (tests/launch/test_report.py) renders hpctrain-report pages in. The demo needs no browser.
for arg in "$@"; do
  case "$arg" in
    --tests) apt_pkgs+=(chromium) ;;
    *) echo "usage: bash scripts/setup.sh [--tests]" >&2; exit 2 ;;
  esac
done
missing=()
for p in "${apt_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  say "apt: installing ${missing[*]}"
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
  say "creating virtual environment $VENV"
  "$PY" -m venv "$VENV"
fi
# (this machine's pip config names local mirrors that may be absent: drop that noise)
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "is neither a file nor a directory" >&2); }

stamp="$VENV/.hpctrain-setup-$(sha1sum pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)"
if [ -f "$stamp" ] && [ "${HPCTRAIN_FORCE_SETUP:-0}" != 1 ]; then
  exit 0   # nothing changed since the last successful set-up
fi

pip install -U "pip>=24" "setuptools>=77" wheel numpy cython pkgconfig "mpi4py>=4.0"

# Parallel h5py: built once per (MPI, HDF5, h5py) and kept outside the repo.
hdf5_ver=$(pkg-config --modversion hdf5-openmpi)
mpi_ver=$(dpkg-query -W -f='${Version}' libopenmpi-dev | tr -c 'A-Za-z0-9.\n' '_')
wheelhouse=${HPCTRAIN_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/hpctrain/wheels/openmpi-${mpi_ver}-hdf5-${hdf5_ver}-py$("$VENV/bin/python" -c 'import sys;print("%d%d"%sys.version_info[:2])')}
mkdir -p "$wheelhouse"
if ! ls "$wheelhouse"/h5py-${H5PY_VERSION}-*.whl >/dev/null 2>&1; then
  say "building h5py ${H5PY_VERSION} against parallel HDF5 ${hdf5_ver} (about 5 minutes, once)"
  CC=mpicc.openmpi HDF5_MPI=ON HDF5_PKGCONFIG_NAME=hdf5-openmpi \
    pip wheel --no-cache-dir --no-deps --no-binary=h5py --no-build-isolation \
      -w "$wheelhouse" "h5py==${H5PY_VERSION}"
fi
pip install --no-index --find-links "$wheelhouse" "h5py==${H5PY_VERSION}"
"$VENV/bin/python" -c 'import h5py,sys; sys.exit(0 if h5py.get_config().mpi else "h5py was built without MPI")'

pip install "$TORCH_SPEC"
pip install -e ".[test]"
# megatron-core, for the tests that read/write Megatron's indexed format with Megatron's own code
# (tests/unit/data/test_indexed.py; skipped without it). Not a dependency of hpctrain. --no-deps: what
# it requires (torch, numpy, packaging) is here already, and pip must never touch the pinned torch.
pip install --no-deps "megatron-core==0.16.1"
rm -f "$VENV"/.hpctrain-setup-*
touch "$stamp"
say "ready: $VENV"
