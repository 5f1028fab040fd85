"""The reference model family: a Llama-style decoder-only transformer."""
from hpctrain.model.build import build_model, materialize, logical_param_count  # noqa: F401
from hpctrain.model.shapes import ModelShape, param_count  # noqa: F401
from hpctrain.model.transformer import Transformer  # noqa: F401
