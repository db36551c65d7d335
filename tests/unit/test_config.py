"""Config loading: the SPEC 5.1 example, errors naming file and key path, env overrides."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from flowforge.config import (
    DEFAULT_BROKER_URL,
    DEFAULT_DATABASE_URL,
    DEFAULT_QUEUE,
    ApiConfig,
    BrokerConfig,
    Config,
    DatabaseConfig,
    load_config,
    redact_url,
)
from flowforge.errors import ConfigError
from flowforge.up import banner

SPEC_EXAMPLE = """\
database:
  url: postgresql://127.0.0.1:5432/flowforge     # FLOWFORGE_DATABASE_URL overrides
broker:
  url: amqp://guest:guest@127.0.0.1:5672/%2F     # FLOWFORGE_BROKER_URL overrides; a list
  queue: flowforge.tasks
handlers: [examples.handlers]                    # modules whose @task functions workers may run
workflows: [config/workflows]                    # YAML files or folders of them
processes:
  workers: 4
api:
  listen: 127.0.0.1:8080                         # omit the api section to run no api child
  token_env: FLOWFORGE_API_TOKEN                 # the bearer token is read from this variable
"""


def write(tmp_path: Path, text: str, name: str = "flowforge.yaml") -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def config_error(path: Path, text: str) -> str:
    write(path.parent, text, path.name)
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    message = str(info.value)
    assert str(path) in message, message
    assert "\n" not in message, message
    return message


def test_spec_example_loads(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, SPEC_EXAMPLE), env={})
    assert config.database.url == "postgresql://127.0.0.1:5432/flowforge"
    assert config.broker.url == ("amqp://guest:guest@127.0.0.1:5672/%2F",)
    assert config.broker.queue == "flowforge.tasks"
    assert config.handlers == ("examples.handlers",)
    assert config.workflows == ("config/workflows",)
    assert config.processes.workers == 4
    assert config.api == ApiConfig(listen="127.0.0.1:8080", token_env="FLOWFORGE_API_TOKEN")
    assert config.base_dir == str(tmp_path.resolve())


def test_broker_url_may_be_a_list_for_a_cluster(tmp_path: Path) -> None:
    path = write(tmp_path, "broker:\n  url: [amqp://a:5672/%2F, amqp://b:5672/%2F]\n")
    assert load_config(path, env={}).broker.url == ("amqp://a:5672/%2F", "amqp://b:5672/%2F")


def test_empty_broker_url_list_is_refused(tmp_path: Path) -> None:
    message = config_error(tmp_path / "c.yaml", "broker:\n  url: []\n")
    assert "broker" in message and "url" in message


def test_api_section_is_optional(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "processes:\n  workers: 2\n"), env={})
    assert config.api is None
    assert config.processes.workers == 2


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, ""), env={})
    assert config.database.url == DEFAULT_DATABASE_URL
    assert config.base_dir == str(tmp_path.resolve())


def test_defaults_when_no_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = load_config(None, env={})
    assert config == Config(base_dir=str(Path.cwd()))
    assert config.database.url == DEFAULT_DATABASE_URL
    assert config.broker.url == (DEFAULT_BROKER_URL,)
    assert config.broker.queue == DEFAULT_QUEUE
    assert config.api is None
    assert config.handlers == () and config.workflows == ()
    assert (config.worker.lease_s, config.worker.heartbeat_s) == (30.0, 10.0)
    assert config.processes.max_tasks_per_child == 0


def test_config_path_is_taken_from_flowforge_config_in_env(tmp_path: Path) -> None:
    path = write(tmp_path, "processes:\n  workers: 7\n")
    config = load_config(None, env={"FLOWFORGE_CONFIG": str(path)})
    assert config.processes.workers == 7


@pytest.mark.parametrize(
    ("text", "key_path"),
    [
        ("broker:\n  queu: x\n", "broker.queu"),
        ("databse:\n  url: x\n", "databse"),
        ("api:\n  listen: x\n  tokn: y\n", "api.tokn"),
        ("base_dir: /etc\n", "base_dir"),
    ],
)
def test_unknown_key_is_named_by_full_path(tmp_path: Path, text: str, key_path: str) -> None:
    message = config_error(tmp_path / "c.yaml", text)
    assert f"{key_path}: unknown key" in message


@pytest.mark.parametrize(
    ("text", "key_path", "expected"),
    [
        ('processes:\n  workers: "four"\n', "processes.workers", "an integer"),
        ("processes:\n  workers: true\n", "processes.workers", "an integer"),
        ("handlers: examples.handlers\n", "handlers", "a list"),
        ("handlers: [1]\n", "handlers[0]", "a string"),
        ("worker:\n  lease_s: soon\n", "worker.lease_s", "a number"),
        ("database: postgresql://x\n", "database", "a mapping"),
    ],
)
def test_wrong_type_is_named_by_path(
    tmp_path: Path, text: str, key_path: str, expected: str
) -> None:
    message = config_error(tmp_path / "c.yaml", text)
    assert f"{key_path}: expected {expected}" in message


@pytest.mark.parametrize(
    ("text", "section", "detail"),
    [
        ("processes:\n  workers: -1\n", "processes", "workers"),
        ("worker:\n  lease_s: 5\n  heartbeat_s: 5\n", "worker", "heartbeat_s"),
        ("database:\n  pool_min: 4\n  pool_max: 2\n", "database", "pool_max"),
        ("logging:\n  format: xml\n", "logging", "format"),
    ],
)
def test_invalid_value_is_named_by_section(
    tmp_path: Path, text: str, section: str, detail: str
) -> None:
    message = config_error(tmp_path / "c.yaml", text)
    assert f"{section}: " in message and detail in message


def test_nan_lease_is_refused(tmp_path: Path) -> None:
    # BUG: YAML `.nan` is a float, and `_positive` / `heartbeat_s >= lease_s` are plain
    # comparisons that are False for NaN, so a NaN lease passes validation.
    config_error(tmp_path / "c.yaml", "worker:\n  lease_s: .nan\n")


def test_invalid_yaml_is_one_line_with_its_line_number(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    message = config_error(path, "database:\n  url: [unclosed\nbroker: {}\n")
    # the position and the parser's own reason
    assert message.startswith(f"{path}:3:7: not valid YAML: ") and "expected ','" in message


@pytest.mark.parametrize(
    ("text", "where", "key"),
    [
        ("database:\n  url: a\ndatabase:\n  url: b\n", ":3:", "database"),
        ("database:\n  url: a\n  url: b\n", ":3:", "url"),
        ("broker:\n  url: [a, b]\n  queue: q\n  queue: r\n", ":4:", "queue"),
    ],
)
def test_a_duplicate_key_is_refused_with_its_line(
    tmp_path: Path, text: str, where: str, key: str
) -> None:
    path = tmp_path / "c.yaml"
    message = config_error(path, text)
    assert message.startswith(f"{path}{where} duplicate key {key!r} (first at line ")


def test_missing_file_is_a_config_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert str(path) in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_non_mapping_top_level_is_refused(tmp_path: Path, text: str) -> None:
    message = config_error(tmp_path / "c.yaml", text)
    assert "mapping" in message


def test_empty_list_top_level_is_refused(tmp_path: Path) -> None:
    # BUG: `yaml.safe_load(text) or {}` turns a falsy non-mapping document ([], 0, false)
    # into {} so it silently loads as the defaults instead of being refused.
    config_error(tmp_path / "c.yaml", "[]\n")


def test_env_overrides_database_url(tmp_path: Path) -> None:
    path = write(tmp_path, SPEC_EXAMPLE)
    config = load_config(path, env={"FLOWFORGE_DATABASE_URL": "postgresql://db.example/ff"})
    assert config.database.url == "postgresql://db.example/ff"
    assert config.broker.url == ("amqp://guest:guest@127.0.0.1:5672/%2F",)


def test_env_overrides_broker_url_with_comma_list(tmp_path: Path) -> None:
    path = write(tmp_path, SPEC_EXAMPLE)
    env = {"FLOWFORGE_BROKER_URL": " amqp://a/%2F, amqp://b/%2F,,amqp://c/%2F "}
    config = load_config(path, env=env)
    assert config.broker.url == ("amqp://a/%2F", "amqp://b/%2F", "amqp://c/%2F")
    assert config.broker.queue == "flowforge.tasks"
    assert config.database.url == "postgresql://127.0.0.1:5432/flowforge"


def test_env_broker_url_without_any_url_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, SPEC_EXAMPLE)
    with pytest.raises(ConfigError, match="FLOWFORGE_BROKER_URL"):
        load_config(path, env={"FLOWFORGE_BROKER_URL": " , ,"})


def test_empty_env_values_do_not_override(tmp_path: Path) -> None:
    path = write(tmp_path, SPEC_EXAMPLE)
    config = load_config(path, env={"FLOWFORGE_DATABASE_URL": "", "FLOWFORGE_BROKER_URL": ""})
    assert config.database.url == "postgresql://127.0.0.1:5432/flowforge"
    assert config.broker.url == ("amqp://guest:guest@127.0.0.1:5672/%2F",)


def test_workflow_paths_are_resolved_against_config_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    absolute = tmp_path / "abs" / "wf.yaml"
    path = write(
        tmp_path / "conf",
        f"workflows: [config/workflows, ../shared/wf.yaml, {absolute}]\n",
    )
    config = load_config(path, env={})
    conf_dir = (tmp_path / "conf").resolve()
    assert config.workflow_paths() == (
        conf_dir / "config" / "workflows",
        (tmp_path / "shared" / "wf.yaml").resolve(),
        absolute.resolve(),
    )


def test_relative_config_path_sets_absolute_base_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(tmp_path / "conf", "workflows: [wf]\n")
    monkeypatch.chdir(tmp_path)
    config = load_config("conf/flowforge.yaml", env={})
    monkeypatch.chdir("/")
    assert config.workflow_paths() == ((tmp_path / "conf" / "wf").resolve(),)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgresql://ff:s3cret@db:5432/flowforge", "postgresql://ff:***@db:5432/flowforge"),
        ("amqp://guest:guest@127.0.0.1:5672/%2F", "amqp://guest:***@127.0.0.1:5672/%2F"),
        ("postgresql://ff:p@ss@db/x", "postgresql://ff:***@db/x"),
        ("postgresql://ff@db/x", "postgresql://ff@db/x"),
        ("postgresql://db/x", "postgresql://db/x"),
        ("not a url", "not a url"),
    ],
)
def test_redact_url_hides_passwords(url: str, expected: str) -> None:
    assert redact_url(url) == expected


@pytest.mark.parametrize(
    "url", ["postgresql://ff:s3cret@db/x", "amqp://u:s3cret@a/%2F", "postgresql://u:s3cret@h1,h2/x"]
)
def test_redact_url_never_contains_the_password(url: str) -> None:
    assert "s3cret" not in redact_url(url)


def test_redact_url_hides_password_given_as_query_parameter() -> None:
    # libpq URIs accept `?password=...`: a query parameter carries a secret too
    assert "s3cret" not in redact_url("postgresql://ff@db/flowforge?password=s3cret")


def test_the_up_banner_names_every_node_and_no_password() -> None:
    config = Config(
        database=DatabaseConfig(
            url="postgresql://ff:s3cret@db1:5432,db2:5432/flowforge?target_session_attrs=read-write"
        ),
        broker=BrokerConfig(url=("amqp://ff:s3cret@mq1/%2F", "amqp://ff:s3cret@mq2/%2F")),
    )
    text = banner(config)
    assert "s3cret" not in text
    assert "db1:5432,db2:5432" in text and "mq1" in text and "mq2" in text
    assert "4 worker(s)" in text
