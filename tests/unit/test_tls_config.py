"""TLS settings in the config: ``broker.tls``, which nodes may use it, and certificate paths
relative to the config file's folder (``database.url``'s ``sslrootcert`` & co too)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from psycopg.conninfo import conninfo_to_dict

from flowforge import tlsfiles
from flowforge.config import BrokerTlsConfig, load_config, redact_url
from flowforge.errors import ConfigError

TLS_URL = "amqps://ff:s3cret@mq.example:5671/%2F"


def write(folder: Path, settings: dict[str, object]) -> Path:
    path = folder / "flowforge.yaml"
    path.write_text(yaml.safe_dump(settings))
    return path


def test_broker_tls_paths_are_under_the_config_folder(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        {
            "broker": {
                "url": [TLS_URL, "amqps://ff:s3cret@10.0.0.2/%2F"],
                "tls": {
                    "ca_file": "certs/ca.pem",
                    "cert_file": "/etc/flowforge/client.pem",
                    "key_file": "certs/../keys/client.key",
                },
            }
        },
    )
    tls = load_config(path, env={}).broker.tls
    assert tls == BrokerTlsConfig(
        ca_file=str(tmp_path / "certs" / "ca.pem"),
        cert_file="/etc/flowforge/client.pem",
        key_file=os.path.join(tmp_path, "certs/../keys/client.key"),  # joined, not resolved
    )


def test_without_broker_tls_there_is_none(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, {"broker": {"url": TLS_URL}}), env={}).broker.tls is None


@pytest.mark.parametrize(
    ("tls", "said"),
    [
        ({"key_file": "k.pem"}, "broker.tls: key_file needs cert_file"),
        ({"ca_file": ""}, "broker.tls: ca_file is empty"),
        ({"ca_path": "x"}, "broker.tls.ca_path: unknown key"),
        ({"ca_file": 3}, "broker.tls.ca_file: expected a string"),
    ],
)
def test_a_bad_broker_tls_is_refused_naming_the_key(
    tmp_path: Path, tls: dict[str, object], said: str
) -> None:
    path = write(tmp_path, {"broker": {"url": TLS_URL, "tls": tls}})
    with pytest.raises(ConfigError, match=said):
        load_config(path, env={})


def test_broker_tls_with_a_plain_node_is_refused_without_its_password(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        {"broker": {"url": [TLS_URL, "amqp://ff:s3cret@mq-2:5672/%2F"], "tls": {}}},
    )
    with pytest.raises(ConfigError) as refused:
        load_config(path, env={})
    said = str(refused.value)
    assert "broker URL 2 (amqp://ff:***@mq-2:5672/%2F) is amqp:// but broker.tls is set" in said
    assert "s3cret" not in said


def test_the_broker_url_override_is_held_to_broker_tls_too(tmp_path: Path) -> None:
    path = write(tmp_path, {"broker": {"url": TLS_URL, "tls": {}}})
    env = {"FLOWFORGE_BROKER_URL": f"{TLS_URL},amqp://mq-2/%2F"}
    with pytest.raises(ConfigError, match=r"broker URL 2 \(amqp://mq-2/%2F\) is amqp://"):
        load_config(path, env=env)


def test_a_node_that_is_not_amqp_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, {"broker": {"url": "http://mq.example/"}})
    with pytest.raises(ConfigError, match=r"broker URL 1 \(.*\) is not an amqp:// or amqps://"):
        load_config(path, env={})


# --- the database URL -----------------------------------------------------------------------


def test_relative_database_certificates_are_under_the_config_folder(tmp_path: Path) -> None:
    url = (
        "postgresql://ff:p%40ss@db.example:5433/orders?sslmode=verify-full"
        "&sslrootcert=certs/ca.pem&sslcert=certs/client.pem&sslkey=/secure/client.key"
        "&sslcrl=crl.pem&application_name=ff"
    )
    config = load_config(write(tmp_path, {"database": {"url": url}}), env={})
    params = conninfo_to_dict(config.database.url)
    assert params == {
        "user": "ff",
        "password": "p@ss",
        "host": "db.example",
        "port": "5433",
        "dbname": "orders",
        "sslmode": "verify-full",
        "sslrootcert": str(tmp_path / "certs" / "ca.pem"),
        "sslcert": str(tmp_path / "certs" / "client.pem"),
        "sslkey": "/secure/client.key",
        "sslcrl": str(tmp_path / "crl.pem"),
        "application_name": "ff",
    }


def test_the_database_url_override_is_resolved_against_the_config_folder(tmp_path: Path) -> None:
    env = {"FLOWFORGE_DATABASE_URL": "host=db dbname=ff sslrootcert='my certs/ca.pem'"}
    config = load_config(write(tmp_path, {}), env=env)
    assert conninfo_to_dict(config.database.url)["sslrootcert"] == str(
        tmp_path / "my certs" / "ca.pem"
    )


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://db.example/orders",  # nothing to resolve: not even parsed
        "postgresql://db.example/orders?sslmode=verify-full&sslrootcert=system",
        "postgresql://db.example/orders?sslrootcert=/etc/ssl/ca.pem",
        "postgresql://db.example/orders?sslrootcert=ca.pem&bad%zz",  # check_url reports it
    ],
)
def test_a_url_without_relative_files_is_kept_as_written(url: str) -> None:
    assert tlsfiles.database_url(url, "/etc/flowforge") == url


def test_without_a_config_file_relative_paths_are_under_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    env = {"FLOWFORGE_DATABASE_URL": "postgresql://db/ff?sslrootcert=ca.pem"}
    config = load_config(None, env=env)
    assert conninfo_to_dict(config.database.url)["sslrootcert"] == str(tmp_path / "ca.pem")


def test_a_rewritten_url_still_hides_its_secrets(tmp_path: Path) -> None:
    url = "postgresql://ff:se%20cret@db/ff?sslrootcert=ca.pem&sslkey=k.pem&sslpassword=hunter2"
    rewritten = load_config(write(tmp_path, {"database": {"url": url}}), env={}).database.url
    shown = redact_url(rewritten)
    assert "se cret" not in shown and "hunter2" not in shown
    assert "password=***" in shown and "sslpassword=***" in shown
    assert f"sslrootcert={tmp_path / 'ca.pem'}" in shown


def test_a_broker_key_others_may_read_is_warned_about(tmp_path: Path) -> None:
    (tmp_path / "client.key").write_text("key")
    (tmp_path / "client.key").chmod(0o644)
    tls = {"cert_file": "client.pem", "key_file": "client.key"}
    config = load_config(write(tmp_path, {"broker": {"url": TLS_URL, "tls": tls}}), env={})
    assert config.warnings == (
        f"broker.tls.key_file: private key {tmp_path / 'client.key'} is readable by group or "
        "others (mode 0644): make it 0400 or 0600, owned by the user FlowForge runs as",
    )
    (tmp_path / "client.key").chmod(0o600)
    assert load_config(tmp_path / "flowforge.yaml", env={}).warnings == ()
