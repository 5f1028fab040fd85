"""``python -m hpctrain`` is ``hpctrain-train``."""
from hpctrain.cli import entry

entry()
