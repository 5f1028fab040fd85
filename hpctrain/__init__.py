"""hpctrain: transformer training for SLURM/MPI supercomputers.

The public API plugins import: hook markers, the Communicator protocol,
the mesh and groups, ShardSpec, config schema and errors.
"""
from hpctrain.hookspecs import hookimpl, hookspec  # noqa: F401

__version__ = "0.1.0"
