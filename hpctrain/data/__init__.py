"""Training data: token sources, the global sample order, the data cursor.

The names below are imported on first use (PEP 562), not with the package:
``hpctrain-prepare`` and its worker processes import ``hpctrain.data.*``
modules that need neither torch nor the cursor, and each would otherwise
pay for importing torch (seconds, and hundreds of MB per worker process).
"""
import importlib

_EXPORTS = {
    "DataCursor": "hpctrain.data.cursor",
    "SampleOrder": "hpctrain.data.cursor",
    "TokenSource": "hpctrain.data.sources",
    "embedded_source": "hpctrain.data.sources",
    "open_source": "hpctrain.data.sources",
    "token_file_source": "hpctrain.data.sources",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
