"""Loading a config: the YAML file, the environment's overrides and the secrets' files.

Relative paths in ``workflows`` and the ``*_file`` keys are resolved against the config file's
directory. Every secret (the database and broker URLs or their passwords, the api token) can
come from a file instead (:mod:`flowforge.secretfiles`); :func:`load_config` reads them, so the
config it returns holds the secrets themselves.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowforge import tlsfiles, yamlfile
from flowforge.config.sections import (
    ApiConfig,
    BrokerConfig,
    BrokerTlsConfig,
    Config,
    DatabaseConfig,
)
from flowforge.durations import parse_duration
from flowforge.errors import ConfigError
from flowforge.redact import redact_url
from flowforge.schema import SchemaError, build
from flowforge.secretfiles import (
    Given,
    Secret,
    amqp_with_password,
    choose,
    pg_holds_password,
    pg_with_password,
    resolve,
    userinfo,
)

logger = logging.getLogger(__name__)

ENV_CONFIG = "FLOWFORGE_CONFIG"
ENV_DATABASE_URL = "FLOWFORGE_DATABASE_URL"
ENV_BROKER_URL = "FLOWFORGE_BROKER_URL"
#: Each secret's file variant: the variable names a file holding what the other one would hold.
FILE_SUFFIX = "_FILE"
ENV_DATABASE_URL_FILE = ENV_DATABASE_URL + FILE_SUFFIX
ENV_DATABASE_PASSWORD_FILE = "FLOWFORGE_DATABASE_PASSWORD_FILE"
ENV_BROKER_URL_FILE = ENV_BROKER_URL + FILE_SUFFIX
ENV_BROKER_PASSWORD_FILE = "FLOWFORGE_BROKER_PASSWORD_FILE"


@dataclass(frozen=True)
class ConfigSource:
    """A config as read, before it is validated: the file's parsed document, the directory its
    relative paths are under, and the name errors give it (the file's path, or ``config``)."""

    data: Mapping[str, Any]
    base_dir: str
    where: str


def read_config(
    path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None
) -> ConfigSource:
    """Read the config file ``path`` (default ``$FLOWFORGE_CONFIG``; with neither, an empty
    document under the working directory). Raises :class:`ConfigError` with one line naming the
    file when it cannot be read or parsed, or does not hold a mapping."""
    env = os.environ if env is None else env
    path = path or env.get(ENV_CONFIG)
    data: Any = {}
    base_dir = Path.cwd()
    if path:
        data, base_dir = _read_yaml(Path(path)), Path(path).resolve().parent
    where = str(path) if path else "config"
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping at the top level")
    return ConfigSource(data, str(base_dir), where)


def config_from(source: ConfigSource, env: Mapping[str, str] | None = None) -> Config:
    """Validate ``source`` and apply the overrides and secrets of ``env`` (default the process
    environment), as :func:`load_config` does after reading the file; no YAML is parsed."""
    env = os.environ if env is None else env
    where = source.where
    try:
        data = _normalise(dict(source.data))
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if "base_dir" in data:
        raise ConfigError(f"{where}: base_dir: unknown key")
    try:
        config = build(Config, {**data, "base_dir": source.base_dir}, "")
    except SchemaError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    try:
        config = _with_secrets(config, data, env)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    _check_broker_urls(config.broker, where)
    return _absolute_files(config)


def load_config(
    path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None
) -> Config:
    """Read, validate and override a config file.

    ``path`` defaults to ``$FLOWFORGE_CONFIG``; with neither, defaults are used. The
    environment's URLs, token and secret files win over the file's (README, "Secrets from
    files"). Raises :class:`ConfigError` with one line naming the file and the key path (or the
    variable), and for a secret file its path and the reason; never a secret.
    """
    env = os.environ if env is None else env
    return config_from(read_config(path, env), env)


def secret_variables(config: Config) -> tuple[str, ...]:
    """The environment variables that may hold one of ``config``'s secrets itself (not a
    file's path): once :func:`load_config` has read them, a long-lived process (the tree
    ``flowforge up`` becomes) drops them from its environment, so no child, handler or program a
    handler starts inherits them. libpq's own variables (``PGPASSWORD``, ...) are not among them:
    libpq reads those at every connection."""
    names = [ENV_DATABASE_URL, ENV_BROKER_URL]
    if config.api is not None:
        names.append(config.api.token_env)
    return tuple(names)


def log_warnings(config: Config) -> None:
    """Log what loading ``config`` found worth a warning; called once logging is set up (a
    config is loaded before that)."""
    for warning in config.warnings:
        logger.warning("%s", warning, extra={"action": "config_warning"})


def _read_yaml(path: Path) -> Any:
    try:
        doc = yamlfile.read(path, "config file")
    except yamlfile.YamlFileError as exc:
        raise ConfigError(str(exc)) from exc
    if doc.duplicates:  # the shared loader refuses what safe_load would silently overwrite
        line, message = doc.duplicates[0]
        raise ConfigError(f"{path}:{line}: {message}")
    return {} if doc.data is None else doc.data


def _normalise(data: dict[str, Any]) -> dict[str, Any]:
    """Accept the documented shorthands: a single broker URL string for ``broker.url``, a
    duration as text for ``events.retention`` (``7d``)."""
    broker = data.get("broker")
    if isinstance(broker, Mapping) and isinstance(broker.get("url"), str):
        data["broker"] = {**broker, "url": [broker["url"]]}
    events = data.get("events")
    if isinstance(events, Mapping) and isinstance(events.get("retention"), str):
        try:
            data["events"] = {**events, "retention": parse_duration(events["retention"])}
        except ValueError as exc:
            raise ConfigError(f"events.retention: {exc}") from None
    return data


def _with_secrets(config: Config, data: Mapping[str, Any], env: Mapping[str, str]) -> Config:
    """``config`` with every secret taken from where it is set, by precedence: the
    environment, then the file (a value or its ``*_file``, never both in one of them)."""
    found = _Secrets(config.base_dir, data, env)
    database, broker = found.database(config.database), found.broker(config.broker)
    api = found.api(config.api) if config.api is not None else None
    return dataclasses.replace(
        config, database=database, broker=broker, api=api, warnings=tuple(found.warnings)
    )


class _Secrets:
    """Finds each secret in the environment ``env`` or the parsed file ``data``; relative
    paths are under ``base_dir``. Collects the warnings reading them gave."""

    def __init__(self, base_dir: str, data: Mapping[str, Any], env: Mapping[str, str]) -> None:
        self.base_dir, self.data, self.env = base_dir, data, env
        self.warnings: list[str] = []

    def in_env(self, name: str, is_file: bool = False) -> Given:
        return Given(name, self.env.get(name) or None, is_file)

    def in_file(self, section: str, key: str, value: str | None, is_file: bool = False) -> Given:
        part = self.data.get(section)
        given = isinstance(part, Mapping) and part.get(key) is not None
        return Given(f"{section}.{key}", value if given else None, is_file)

    def read(self, given: Given, multiline: bool = False) -> Secret:
        secret = resolve(given, self.base_dir, multiline=multiline)
        if secret.warning:
            self.warnings.append(secret.warning)
        return secret

    def password(self, env_name: str, section: str, value: str | None) -> Given | None:
        return choose(
            (self.in_env(env_name, True),),
            (self.in_file(section, "password_file", value, True),),
        )

    def database(self, db: DatabaseConfig) -> DatabaseConfig:
        url_from = choose(
            (self.in_env(ENV_DATABASE_URL), self.in_env(ENV_DATABASE_URL_FILE, True)),
            (
                self.in_file("database", "url", db.url),
                self.in_file("database", "url_file", db.url_file, True),
            ),
        )
        url = self.read(url_from) if url_from else Secret(db.url, "the default database.url")
        password_from = self.password(ENV_DATABASE_PASSWORD_FILE, "database", db.password_file)
        if password_from and pg_holds_password(url.text):
            raise ConfigError(
                f"{password_from.name} and a password in the database URL ({url.source}) are "
                "both set: set one of them"
            )
        password = self.read(password_from) if password_from else None
        return dataclasses.replace(
            db,
            url=pg_with_password(url.text, password.text) if password else url.text,
            url_file=_path(url),
            password_file=_path(password),
        )

    def broker(self, broker: BrokerConfig) -> BrokerConfig:
        urls_from = choose(
            (self.in_env(ENV_BROKER_URL), self.in_env(ENV_BROKER_URL_FILE, True)),
            (
                # broker.url's list stays where it is: only whether the file set it matters
                self.in_file("broker", "url", "set"),
                self.in_file("broker", "url_file", broker.url_file, True),
            ),
        )
        urls, source, urls_file = broker.url, "the default broker.url", None
        if urls_from and urls_from.name != "broker.url":
            found = self.read(urls_from, multiline=True)
            urls = tuple(u.strip() for u in re.split(r"[,\n]", found.text) if u.strip())
            if not urls:
                raise ConfigError(f"{found.source} holds no URL")
            source, urls_file = found.source, _path(found)
        elif urls_from:
            source = urls_from.name
        password_from = self.password(ENV_BROKER_PASSWORD_FILE, "broker", broker.password_file)
        password = None
        if password_from:
            _check_broker_users(urls, source, password_from.name)
            password = self.read(password_from)
            urls = tuple(amqp_with_password(u, password.text) for u in urls)
        else:
            _check_broker_passwords(urls, source)
        return dataclasses.replace(
            broker, url=urls, url_file=urls_file, password_file=_path(password)
        )

    def api(self, api: ApiConfig) -> ApiConfig:
        token_from = choose(
            (self.in_env(api.token_env), self.in_env(api.token_env + FILE_SUFFIX, True)),
            (self.in_file("api", "token_file", api.token_file, True),),
        )
        token = self.read(token_from) if token_from else None
        return dataclasses.replace(
            api, token=token.text if token else None, token_file=_path(token)
        )


def _check_broker_urls(broker: BrokerConfig, where: str) -> None:
    """Every node is ``amqp://`` or ``amqps://``; with ``broker.tls`` every one is ``amqps://``
    (a plain node would silently go without the TLS the config asks for)."""
    for i, url in enumerate(broker.url, 1):
        scheme = url.partition("://")[0].lower() if "://" in url else ""
        if scheme not in ("amqp", "amqps"):
            raise ConfigError(
                f"{where}: broker URL {i} ({redact_url(url)}) is not an amqp:// or amqps:// URL"
            )
        if scheme == "amqp" and broker.tls is not None:
            raise ConfigError(
                f"{where}: broker URL {i} ({redact_url(url)}) is amqp:// but broker.tls is set: "
                "use amqps:// for every node (or remove broker.tls)"
            )


def _absolute_files(config: Config) -> Config:
    """Certificate and key paths (``database.url``'s ``sslrootcert`` & co, ``broker.tls``)
    made absolute against the config file's directory (flowforge/tlsfiles.py); a warning if
    ``broker.tls.key_file`` is readable by others."""
    base = config.base_dir
    database = dataclasses.replace(
        config.database, url=tlsfiles.database_url(config.database.url, base)
    )
    broker, tls, warnings = config.broker, config.broker.tls, list(config.warnings)
    if tls is not None:
        tls = BrokerTlsConfig(
            *(None if f is None else tlsfiles.absolute(f, base) for f in dataclasses.astuple(tls))
        )
        broker = dataclasses.replace(broker, tls=tls)
        key = tls.key_file and tlsfiles.open_key_warning("broker.tls.key_file", tls.key_file)
        warnings += [key] if key else []
    return dataclasses.replace(config, database=database, broker=broker, warnings=tuple(warnings))


def _check_broker_users(urls: tuple[str, ...], source: str, password_name: str) -> None:
    """A password file needs every node's URL to name a user and hold no password."""
    for i, url in enumerate(urls, 1):
        found = userinfo(url)
        if found is None or not found[0]:
            raise ConfigError(
                f"{password_name}: broker URL {i} ({redact_url(url)}, from {source}) names no"
                " user: write it as amqp://USER@HOST:PORT/VHOST"
            )
        if found[1] is not None:
            raise ConfigError(
                f"{password_name} and a password in broker URL {i} ({source}) are both set:"
                " set one of them"
            )


def _check_broker_passwords(urls: tuple[str, ...], source: str) -> None:
    """A node naming a user without a password (pika cannot even parse it) is most likely one
    whose password file was forgotten."""
    for i, url in enumerate(urls, 1):
        found = userinfo(url)
        if found is not None and found[1] is None:
            raise ConfigError(
                f"broker URL {i} ({redact_url(url)}, from {source}) names a user but no"
                f" password: set {ENV_BROKER_PASSWORD_FILE} or broker.password_file"
            )


def _path(secret: Secret | None) -> str | None:
    return str(secret.path) if secret and secret.path else None
