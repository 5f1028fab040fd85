"""ZeRO stages 1/2/3 (FSDP-style) over the data axes: sharded optimizer
state, gradients and parameters. See ``plugin`` for how the stages work and
``docs/zero.md`` for the user's view."""
