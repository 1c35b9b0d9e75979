"""The run's configuration: the schema every key is checked against (``schema``: sections,
defaults, documentation, cross-field rules), reading presets and ``--set`` overrides
(``loading``), ``rayrlhf config`` (``help``) and each role's own settings picked from the run's
config (``role_settings``). A role receives its small config from here, never the whole run's.

The schema's names are importable from ``cluster.config`` itself."""

from cluster.config.schema import (  # noqa: F401
    Config,
    ConfigError,
    DPOConfig,
    DataSourceConfig,
    IMMUTABLE_ON_RESUME,
    LoRAConfig,
    MOVED_KEYS,
    PPOConfig,
    QLearnConfig,
    RewardModelConfig,
    SFTConfig,
    Section,
    StageConfig,
    TrainConfig,
    UserError,
)
