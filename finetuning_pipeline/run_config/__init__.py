"""The run configuration: its schema (a leaf: no runtime module), the YAML loader with
key=value overrides, the validation. What the rest of the code imports comes from here."""

from finetuning_pipeline.errors import ConfigError
from finetuning_pipeline.run_config.load import load_config, read_config_file
from finetuning_pipeline.run_config.schema import (
                                                   AdapterConfig,
                                                   CheckpointConfig,
                                                   EvalConfig,
                                                   GpuConfig,
                                                   LoggingConfig,
                                                   ModelConfig,
                                                   ParallelConfig,
                                                   PhaseConfig,
                                                   PreferenceConfig,
                                                   RunConfig,
                                                   RuntimeConfig,
                                                   TpuConfig,
                                                   TrainConfig,
                                                   WandbConfig,
                                                   XlaConfig,
                                                   phase_number,
)

__all__ = ["AdapterConfig", "CheckpointConfig", "ConfigError", "EvalConfig", "GpuConfig", "LoggingConfig",
           "ModelConfig", "ParallelConfig", "PhaseConfig", "PreferenceConfig", "RunConfig", "RuntimeConfig",
           "TpuConfig", "TrainConfig", "WandbConfig", "XlaConfig", "load_config", "phase_number", "read_config_file"]
