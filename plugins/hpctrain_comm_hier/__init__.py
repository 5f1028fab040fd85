"""Hierarchical communicator backend (``comm.backend=hier``).

Composes an intra-node and an inter-node backend (``comm.hier.intra``,
``comm.hier.inter``), obtained through the ``hpctrain_make_backend`` hook so
any installed backend can play either part. Modules: ``plugin`` (hooks and
the ``comm.hier`` config section), ``layout`` (how groups split into nodes:
pure logic), ``communicator`` (the two-level algorithms).
"""
