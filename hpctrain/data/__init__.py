"""Training data: token sources, the global sample order, the data cursor."""
from hpctrain.data.cursor import DataCursor, SampleOrder  # noqa: F401
from hpctrain.data.sources import TokenSource, embedded_source, open_source, token_file_source  # noqa: F401
