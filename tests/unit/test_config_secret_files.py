"""Secrets from files: every ``*_file`` key and ``FLOWFORGE_*_FILE`` variable, their precedence,
passwords merged into URLs exactly, and every refusal as one line that never holds the secret.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Any

import pika
import pytest
from psycopg.conninfo import conninfo_to_dict

from flowforge import secretfiles
from flowforge.config import DEFAULT_BROKER_URL, load_config, log_warnings
from flowforge.errors import ConfigError
from flowforge.up import banner

SECRET = "s3cret-4f9d"
#: Every character a URL or a libpq string could stumble on.
AWKWARD = "p@ss:w/rd?&=#% 'q\"\\ü;,"
DB = "postgresql://ff@db1:5432/flowforge"
MQ = "amqp://ff@mq1:5672/%2F"


def secret_file(directory: Path, name: str, text: str, mode: int = 0o600) -> Path:
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode())
    path.chmod(mode)
    return path


def config_file(directory: Path, text: str) -> Path:
    path = directory / "flowforge.yaml"
    path.write_text(text)
    return path


def load(directory: Path, text: str = "", **env: str) -> Any:
    return load_config(config_file(directory, text), env=env)


def refused(directory: Path, text: str = "", **env: str) -> str:
    """The one-line message of the ConfigError loading raises; it never holds the secret."""
    with pytest.raises(ConfigError) as info:
        load(directory, text, **env)
    message = str(info.value)
    assert "\n" not in message, message
    assert str(directory / "flowforge.yaml") in message, message
    assert SECRET not in message, message
    return message


# ------------------------------------------------------------------ every key and variable


def test_database_url_from_a_config_key_and_from_a_variable(tmp_path: Path) -> None:
    url = f"postgresql://ff:{SECRET}@db1:5432/flowforge"
    path = secret_file(tmp_path, "db-url", url + "\n")
    config = load(tmp_path, "database:\n  url_file: db-url\n")
    assert config.database.url == url
    assert config.database.url_file == str(path)
    config = load(tmp_path, FLOWFORGE_DATABASE_URL_FILE=str(path))
    assert config.database.url == url


def test_database_password_from_a_config_key_and_from_a_variable(tmp_path: Path) -> None:
    path = secret_file(tmp_path, "db-password", SECRET + "\n")
    for config in (
        load(tmp_path, f"database:\n  url: {DB}\n  password_file: {path}\n"),
        load(tmp_path, f"database:\n  url: {DB}\n", FLOWFORGE_DATABASE_PASSWORD_FILE=str(path)),
        load(tmp_path, FLOWFORGE_DATABASE_URL=DB, FLOWFORGE_DATABASE_PASSWORD_FILE=str(path)),
    ):
        params = conninfo_to_dict(config.database.url)
        assert params == {**conninfo_to_dict(DB), "password": SECRET}
        assert config.database.password_file == str(path)
        assert config.database.url_file is None


def test_broker_urls_from_a_file_one_per_line_or_comma_separated(tmp_path: Path) -> None:
    urls = (f"amqp://ff:{SECRET}@mq1:5672/%2F", f"amqp://ff:{SECRET}@mq2:5672/%2F")
    lines = secret_file(tmp_path, "mq-lines", f"{urls[0]}\n\n{urls[1]}\n")
    commas = secret_file(tmp_path, "mq-commas", f"{urls[0]}, {urls[1]}")
    assert load(tmp_path, "broker:\n  url_file: mq-lines\n").broker.url == urls
    assert load(tmp_path, FLOWFORGE_BROKER_URL_FILE=str(commas)).broker.url == urls
    assert load(tmp_path, FLOWFORGE_BROKER_URL_FILE=str(lines)).broker.url_file == str(lines)


def test_broker_password_goes_into_every_node(tmp_path: Path) -> None:
    path = secret_file(tmp_path, "mq-password", SECRET)
    nodes = "broker:\n  url: [amqp://ff@mq1:5672/%2F, amqps://ff@mq2:5671/prod]\n"
    for config in (
        load(tmp_path, nodes + "  password_file: mq-password\n"),
        load(tmp_path, nodes, FLOWFORGE_BROKER_PASSWORD_FILE=str(path)),
        load(
            tmp_path,
            FLOWFORGE_BROKER_URL="amqp://ff@mq1:5672/%2F,amqps://ff@mq2:5671/prod",
            FLOWFORGE_BROKER_PASSWORD_FILE=str(path),
        ),
    ):
        parsed = [pika.URLParameters(u) for u in config.broker.url]
        assert [(p.host, p.port) for p in parsed] == [("mq1", 5672), ("mq2", 5671)]
        assert [(p.credentials.username, p.credentials.password) for p in parsed] == [
            ("ff", SECRET),
            ("ff", SECRET),
        ]
        assert config.broker.password_file == str(path)


@pytest.mark.parametrize("token_env", ["FLOWFORGE_API_TOKEN", "MY_TOKEN"])
def test_api_token_from_its_variable_its_file_variable_or_the_config_key(
    tmp_path: Path, token_env: str
) -> None:
    path = secret_file(tmp_path, "api-token", SECRET + "\r\n")
    api = f"api:\n  token_env: {token_env}\n"
    assert load(tmp_path, api).api.token is None
    assert load(tmp_path, api, **{token_env: SECRET}).api.token == SECRET
    assert load(tmp_path, api, **{token_env + "_FILE": str(path)}).api.token == SECRET
    config = load(tmp_path, api + "  token_file: api-token\n")
    assert (config.api.token, config.api.token_file) == (SECRET, str(path))


def test_without_an_api_section_no_token_is_read(tmp_path: Path) -> None:
    config = load(tmp_path, FLOWFORGE_API_TOKEN_FILE=str(tmp_path / "missing"))
    assert config.api is None


@pytest.mark.parametrize(
    ("section", "key"), [("api", "token"), ("", "warnings")], ids=["api.token", "warnings"]
)
def test_what_the_loader_fills_in_cannot_be_written_in_the_file(
    tmp_path: Path, section: str, key: str
) -> None:
    text = f"{section}:\n  {key}: {SECRET}\n" if section else f"{key}: [{SECRET}]\n"
    key_path = f"{section}.{key}" if section else key
    assert f"{key_path}: unknown key" in refused(tmp_path, text)


def test_the_token_is_in_no_repr_of_the_config(tmp_path: Path) -> None:
    config = load(tmp_path, "api:\n  listen: 127.0.0.1:8080\n", FLOWFORGE_API_TOKEN=SECRET)
    assert config.api.token == SECRET
    assert SECRET not in repr(config) and SECRET not in str(config)


# ------------------------------------------------------------------ precedence


def test_the_environment_wins_over_the_file_in_either_form(tmp_path: Path) -> None:
    from_env = secret_file(tmp_path, "env-url", "postgresql://env-host/db")
    from_file = secret_file(tmp_path, "file-url", "postgresql://file-host/db")
    text = f"database:\n  url_file: {from_file}\n"
    assert load(tmp_path, text, FLOWFORGE_DATABASE_URL="postgresql://value/db").database.url == (
        "postgresql://value/db"
    )
    config = load(
        tmp_path,
        "database:\n  url: postgresql://f/db\n",
        **{"FLOWFORGE_DATABASE_URL_FILE": str(from_env)},
    )
    assert (config.database.url, config.database.url_file) == (
        "postgresql://env-host/db",
        str(from_env),
    )
    env_token = secret_file(tmp_path, "env-token", "from-env")
    secret_file(tmp_path, "file-token", "from-file")
    api = "api:\n  token_file: file-token\n"
    assert load(tmp_path, api, FLOWFORGE_API_TOKEN="value").api.token == "value"
    assert load(tmp_path, api, FLOWFORGE_API_TOKEN_FILE=str(env_token)).api.token == "from-env"


def test_empty_variables_do_not_count_as_set(tmp_path: Path) -> None:
    path = secret_file(tmp_path, "db-url", "postgresql://from-file/db")
    config = load(
        tmp_path,
        "database:\n  url_file: db-url\n",
        FLOWFORGE_DATABASE_URL="",
        FLOWFORGE_DATABASE_URL_FILE="",
        FLOWFORGE_DATABASE_PASSWORD_FILE="",
    )
    assert config.database.url == "postgresql://from-file/db" and path.exists()


@pytest.mark.parametrize(
    ("text", "env", "names"),
    [
        (f"database:\n  url: {DB}\n  url_file: x\n", {}, "database.url and database.url_file"),
        (
            "",
            {"FLOWFORGE_DATABASE_URL": DB, "FLOWFORGE_DATABASE_URL_FILE": "x"},
            "FLOWFORGE_DATABASE_URL and FLOWFORGE_DATABASE_URL_FILE",
        ),
        (f"broker:\n  url: {MQ}\n  url_file: x\n", {}, "broker.url and broker.url_file"),
        (
            "",
            {"FLOWFORGE_BROKER_URL": MQ, "FLOWFORGE_BROKER_URL_FILE": "x"},
            "FLOWFORGE_BROKER_URL and FLOWFORGE_BROKER_URL_FILE",
        ),
        (
            "api:\n  listen: 127.0.0.1:8080\n",
            {"FLOWFORGE_API_TOKEN": SECRET, "FLOWFORGE_API_TOKEN_FILE": "x"},
            "FLOWFORGE_API_TOKEN and FLOWFORGE_API_TOKEN_FILE",
        ),
    ],
    ids=["database.url", "$DATABASE_URL", "broker.url", "$BROKER_URL", "$API_TOKEN"],
)
def test_a_value_and_its_file_in_one_place_are_refused_by_name(
    tmp_path: Path, text: str, env: dict[str, str], names: str
) -> None:
    secret_file(tmp_path, "x", SECRET)
    assert f"{names} are both set: set one of them" in refused(tmp_path, text, **env)


@pytest.mark.parametrize(
    ("url", "source"),
    [
        (f"postgresql://ff:{SECRET}@db1/flowforge", "database.url"),
        (f"postgresql://ff@db1/flowforge?sslmode=require&password={SECRET}", "database.url"),
        (f"host=db1 user=ff password={SECRET}", "database.url"),
    ],
)
def test_a_password_file_with_a_password_in_the_database_url_is_refused(
    tmp_path: Path, url: str, source: str
) -> None:
    path = secret_file(tmp_path, "pw", "other")
    message = refused(tmp_path, f"database:\n  url: '{url}'\n  password_file: {path}\n")
    assert (
        f"database.password_file and a password in the database URL ({source}) are both set"
    ) in message
    message = refused(tmp_path, FLOWFORGE_DATABASE_URL=url, FLOWFORGE_DATABASE_PASSWORD_FILE="pw")
    assert "FLOWFORGE_DATABASE_PASSWORD_FILE and a password in the database URL" in message
    assert "(FLOWFORGE_DATABASE_URL)" in message


def test_a_broker_password_file_needs_a_user_and_no_password_in_every_node(
    tmp_path: Path,
) -> None:
    secret_file(tmp_path, "pw", "other")
    nodes = f"broker:\n  url: [{MQ}, 'amqp://mq2:5672/%2F?token={SECRET}']\n  password_file: pw\n"
    message = refused(tmp_path, nodes)
    assert "broker.password_file: broker URL 2 (amqp://mq2:5672/%2F?token=***" in message
    assert "names no user: write it as amqp://USER@HOST:PORT/VHOST" in message
    message = refused(
        tmp_path,
        f"broker:\n  url: [{MQ}, 'amqp://ff:{SECRET}@mq2/']\n",
        **{"FLOWFORGE_BROKER_PASSWORD_FILE": "pw"},
    )
    assert (
        "FLOWFORGE_BROKER_PASSWORD_FILE and a password in broker URL 2 (broker.url) are both set"
    ) in message
    # the default URL holds guest's password: a password file needs a URL naming its user
    message = refused(tmp_path, "broker:\n  password_file: pw\n")
    assert "broker URL 1 (the default broker.url) are both set" in message
    assert DEFAULT_BROKER_URL.startswith("amqp://guest:guest@")


def test_a_broker_user_without_a_password_or_a_password_file_is_refused(tmp_path: Path) -> None:
    """pika cannot parse ``amqp://user@host`` (a TypeError at connect): said at load instead."""
    message = refused(tmp_path, f"broker:\n  url: [amqp://ff:{SECRET}@mq1/%2F, {MQ}]\n")
    assert message.endswith(
        f"broker URL 2 ({MQ}, from broker.url) names a user but no password: set"
        " FLOWFORGE_BROKER_PASSWORD_FILE or broker.password_file"
    ), message
    assert load(tmp_path, "broker:\n  url: amqp://ff:@mq1/%2F\n").broker.url == (
        "amqp://ff:@mq1/%2F",
    )


# ------------------------------------------------------------------ passwords into URLs


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://ff@db1:5432,db2:5432/flowforge?target_session_attrs=read-write",
        "postgresql://db1/flowforge",
        "postgres://ff@db1/flowforge?",
        "host=db1 user=ff dbname=flowforge",
        "",
    ],
)
def test_a_merged_database_password_reads_back_exactly(url: str) -> None:
    merged = secretfiles.pg_with_password(url, AWKWARD)
    assert conninfo_to_dict(merged) == {**conninfo_to_dict(url), "password": AWKWARD}
    assert secretfiles.pg_holds_password(merged) and not secretfiles.pg_holds_password(url)


@pytest.mark.parametrize(
    ("url", "user", "host", "port", "vhost"),
    [
        (MQ, "ff", "mq1", 5672, "/"),
        ("amqps://flow%40forge@mq1/prod?heartbeat=5", "flow@forge", "mq1", 5671, "prod"),
    ],
)
def test_a_merged_broker_password_reads_back_exactly(
    url: str, user: str, host: str, port: int, vhost: str
) -> None:
    merged = pika.URLParameters(secretfiles.amqp_with_password(url, AWKWARD))
    assert (merged.credentials.username, merged.credentials.password) == (user, AWKWARD)
    assert (merged.host, merged.port, merged.virtual_host) == (host, port, vhost)


def test_the_banner_shows_no_password_that_came_from_a_file(tmp_path: Path) -> None:
    secret_file(tmp_path, "pw", SECRET)
    config = load(
        tmp_path,
        f"database:\n  url: {DB}\n  password_file: pw\n"
        f"broker:\n  url: [{MQ}, amqp://ff@mq2/%2F]\n  password_file: pw\n",
    )
    shown = banner(config)
    assert SECRET not in shown
    assert f"{DB}?password=***" in shown
    assert "amqp://ff:***@mq1:5672/%2F, amqp://ff:***@mq2/%2F" in shown


# ------------------------------------------------------------------ reading a file


def test_one_trailing_newline_is_removed_and_no_more(tmp_path: Path) -> None:
    for text, expected in [(SECRET, SECRET), (SECRET + "\n", SECRET), (SECRET + "\r\n", SECRET)]:
        path = secret_file(tmp_path, "t", text)
        assert load(tmp_path, "api:\n  token_file: t\n").api.token == expected, path
    secret_file(tmp_path, "t", f" {SECRET} \n")
    assert load(tmp_path, "api:\n  token_file: t\n").api.token == f" {SECRET} "


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("", "is empty"),
        ("\n", "is empty"),
        (SECRET + "\n\n", "holds more than one line"),
        (SECRET + "\nsecond", "holds more than one line"),
        (SECRET + "\x00" * secretfiles.MAX_BYTES, f"larger than {secretfiles.MAX_BYTES} bytes"),
    ],
    ids=["empty", "newline", "two-newlines", "two-lines", "too-big"],
)
def test_a_bad_secret_file_is_one_line_with_key_path_and_reason(
    tmp_path: Path, content: str, reason: str
) -> None:
    path = secret_file(tmp_path, "pw", content)
    message = refused(tmp_path, f"database:\n  url: {DB}\n  password_file: pw\n")
    assert message.endswith(f"database.password_file: cannot use {path}: {reason}"), message


def test_a_file_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "pw"
    path.write_bytes(b"\xff\xfe" + SECRET.encode())
    message = refused(tmp_path, FLOWFORGE_DATABASE_PASSWORD_FILE=str(path))
    assert message.endswith(f"FLOWFORGE_DATABASE_PASSWORD_FILE: cannot use {path}: not UTF-8 text")


def test_a_missing_file_a_directory_and_a_fifo_are_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # nobody writes to it: reading must not wait for a writer
    for env_name in ("FLOWFORGE_DATABASE_URL_FILE", "FLOWFORGE_BROKER_PASSWORD_FILE"):
        for target, reason in [
            (tmp_path / "missing", "No such file or directory"),
            (tmp_path, "is a directory"),
            (fifo, "not a regular file"),
        ]:
            message = refused(tmp_path, "", FLOWFORGE_BROKER_URL=MQ, **{env_name: str(target)})
            assert message.endswith(f"{env_name}: cannot use {target}: {reason}"), message


def test_an_unreadable_file_says_permission_denied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = secret_file(tmp_path, "token", SECRET, mode=0o000)
    real_open = os.open

    def as_another_user(file: Any, flags: int, *args: Any) -> int:
        # the suite may run as root, which reads any file: deny it as the kernel would
        if Path(file) == path:
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, flags, *args)

    monkeypatch.setattr(os, "open", as_another_user)
    message = refused(tmp_path, "api:\n  token_file: token\n")
    assert message.endswith(f"api.token_file: cannot use {path}: Permission denied"), message


def test_relative_paths_are_under_the_config_files_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "etc"
    secret_file(folder, "secrets/pw", SECRET)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    for config in (
        load(folder, f"database:\n  url: {DB}\n  password_file: secrets/pw\n"),
        load(folder, f"database:\n  url: {DB}\n", FLOWFORGE_DATABASE_PASSWORD_FILE="secrets/pw"),
    ):
        assert conninfo_to_dict(config.database.url)["password"] == SECRET
        assert config.database.password_file == str(folder.resolve() / "secrets/pw")


# ------------------------------------------------------------------ permissions


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o444])
def test_a_file_others_may_read_is_used_with_a_warning_naming_it(
    tmp_path: Path, mode: int, caplog: pytest.LogCaptureFixture
) -> None:
    path = secret_file(tmp_path, "token", SECRET, mode=mode)
    config = load(tmp_path, "api:\n  token_file: token\n")
    assert config.api.token == SECRET
    assert config.warnings == (
        f"api.token_file: secret file {path} is readable by group or others (mode {mode:04o}):"
        " make it 0400 or 0600, owned by the user FlowForge runs as",
    )
    with caplog.at_level(logging.WARNING, logger="flowforge.config"):
        log_warnings(config)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, config.warnings[0])
    ]
    assert SECRET not in caplog.text


@pytest.mark.parametrize("mode", [0o400, 0o600, 0o700, 0o620])
def test_a_file_only_its_owner_may_read_gives_no_warning(tmp_path: Path, mode: int) -> None:
    secret_file(tmp_path, "token", SECRET, mode=mode)
    config = load(tmp_path, "api:\n  token_file: token\n")
    assert config.api.token == SECRET and config.warnings == ()
    assert stat.S_IMODE((tmp_path / "token").stat().st_mode) == mode
