"""Parallel HDF5 checkpoints (``checkpoint.format=hdf5``).

One HDF5 file per checkpoint, written collectively through MPI-IO: every
parameter and optimizer-state tensor is one dataset in its logical
(unsharded) shape, each rank writes only the hyperslab it owns, and any
layout loads it by reading only its own hyperslabs. Atomic commit, keep-k,
checksummed, optionally asynchronous; a serial fallback when h5py lacks MPI.
See docs/checkpointing.md for the format and its guarantees.

Modules: ``plugin`` (hooks), ``options`` (config section), ``layout`` (boxes
and the write plan), ``checksum``, ``h5io`` (h5py calls), ``writer``,
``reader``, ``snapshot`` / ``restore`` (trainer state <-> datasets),
``store`` (directory, commit, keep-k), ``asyncsave``, ``checkpointer``,
``export`` (safetensors in Hugging Face naming), ``cli`` (hpctrain-ckpt).
"""
