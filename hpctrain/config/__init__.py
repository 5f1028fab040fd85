"""Configuration: typed schema, Hydra registration and composition, validation."""
from typing import Any, Dict, cast

from omegaconf import OmegaConf

from hpctrain.config.schema import (  # noqa: F401
    CheckpointConfig,
    ClusterConfig,
    CommConfig,
    DataConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    ReliabilityConfig,
    TrainConfig,
    TrainerConfig,
)
from hpctrain.config.store import (  # noqa: F401
    CONF_DIR,
    build_schema,
    compose,
    compose_agreed,
    compose_resolved,
    register_configs,
    to_config,
)
from hpctrain.config.validate import validate  # noqa: F401


def plugin_section(cfg, key: str, cls):
    """A plugin's typed config section ``key`` (e.g. ``parallel.zero``) as an
    instance of its dataclass ``cls``; the defaults when the config lacks it."""
    node = OmegaConf.select(cfg, key, default=None)
    if node is None:
        return cls()
    if not OmegaConf.is_config(node):
        return node
    # (cast: OmegaConf types to_container for any node; a section is a mapping)
    return cls(**cast(Dict[str, Any], OmegaConf.to_container(node, resolve=True)))
