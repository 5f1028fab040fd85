"""MPI communicator backend (``comm.backend=mpi``): mpi4py directly on tensors.

Modules: ``plugin`` (hooks and the ``comm.mpi`` config section),
``communicator`` (the collectives), ``buffers`` (how a tensor becomes an MPI
buffer: zero-copy views, staging copies, GPU paths), ``dtypes`` (which torch
dtypes travel and reduce as which MPI types), ``subcomm`` (one MPI
sub-communicator per group), ``agree`` (the optional cross-rank shape check).
"""
