"""Configuration: a YAML file turned into frozen dataclasses, validated, with env overrides.

Nothing is read at import time: :func:`load_config` is called by whoever needs a config. The
sections and their checks are :mod:`flowforge.config.sections`; reading the file, the
environment and the secrets' files is :mod:`flowforge.config.loading`. Both are re-exported
here, the names the rest of FlowForge and its users import.
"""

from flowforge.config.loading import (
    ENV_BROKER_PASSWORD_FILE,
    ENV_BROKER_URL,
    ENV_BROKER_URL_FILE,
    ENV_CONFIG,
    ENV_DATABASE_PASSWORD_FILE,
    ENV_DATABASE_URL,
    ENV_DATABASE_URL_FILE,
    FILE_SUFFIX,
    ConfigSource,
    config_from,
    load_config,
    log_warnings,
    read_config,
    secret_variables,
)
from flowforge.config.sections import (
    DEFAULT_BROKER_URL,
    DEFAULT_DATABASE_URL,
    DEFAULT_QUEUE,
    DEFAULT_TOKEN_ENV,
    MAX_API_PROCESSES,
    MAX_PREFETCH,
    ApiConfig,
    BrokerConfig,
    BrokerTlsConfig,
    Config,
    DatabaseConfig,
    EventsConfig,
    IPNetwork,
    LoggingConfig,
    PoolConfig,
    ProcessesConfig,
    ReadAccess,
    SchedulerConfig,
    WorkerConfig,
)
from flowforge.redact import redact_url  # README: flowforge.config.redact_url

__all__ = [
    "DEFAULT_BROKER_URL",
    "DEFAULT_DATABASE_URL",
    "DEFAULT_QUEUE",
    "DEFAULT_TOKEN_ENV",
    "ENV_BROKER_PASSWORD_FILE",
    "ENV_BROKER_URL",
    "ENV_BROKER_URL_FILE",
    "ENV_CONFIG",
    "ENV_DATABASE_PASSWORD_FILE",
    "ENV_DATABASE_URL",
    "ENV_DATABASE_URL_FILE",
    "FILE_SUFFIX",
    "MAX_API_PROCESSES",
    "MAX_PREFETCH",
    "ApiConfig",
    "BrokerConfig",
    "BrokerTlsConfig",
    "Config",
    "ConfigSource",
    "DatabaseConfig",
    "EventsConfig",
    "IPNetwork",
    "LoggingConfig",
    "PoolConfig",
    "ProcessesConfig",
    "ReadAccess",
    "SchedulerConfig",
    "WorkerConfig",
    "config_from",
    "load_config",
    "log_warnings",
    "read_config",
    "redact_url",
    "secret_variables",
]
