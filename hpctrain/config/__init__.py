"""Configuration: typed schema, Hydra registration and composition, validation."""
from hpctrain.config.schema import (  # noqa: F401
    CheckpointConfig,
    ClusterConfig,
    CommConfig,
    DataConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
    TrainerConfig,
)
from hpctrain.config.store import CONF_DIR, build_schema, compose, compose_resolved, register_configs, to_config  # noqa: F401
from hpctrain.config.validate import validate  # noqa: F401
