"""Text no setting can hold — a NUL byte (libpq and URL parsers cut a string there and use the
rest: a database named "post" instead of "post<NUL>gres", a truncated password read as an
authentication failure) or a lone surrogate (not encodable, so psycopg raised UnicodeEncodeError
from inside a command) — is refused when the config is loaded, wherever the text comes from: a
value in the file, a secret file's content, a path to a secret or certificate. One line naming
the key, exit 2, never the value.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flowforge.cli import exitcodes
from flowforge.cli.main import main
from flowforge.config import load_config
from flowforge.definitions import check_file
from flowforge.errors import ConfigError

SECRET = "s3cret-77ab"
MQ = "amqp://guest:guest@127.0.0.1:5672/%2F"
DB = "postgresql://postgres@127.0.0.1:5432/flowforge"
#: YAML double-quoted escapes for the two classes of bad text.
BAD = {"nul": "\\0", "surrogate": "\\ud800"}
REASON = {"nul": "holds a NUL byte", "surrogate": "holds a lone surrogate"}


def yaml_with(key: str, bad: str) -> str:
    """A config whose ``key`` holds the bad character ``bad`` among a secret's letters."""
    value = {
        "database.url": (
            f'database:\n  url: "postgresql://u:{SECRET}{bad}@db/x"\nbroker:\n  url: {MQ}\n'
        ),
        "broker.url[0]": f'database:\n  url: {DB}\nbroker:\n  url: "amqp://u:{SECRET}{bad}@mq/%2F"\n',
        "database.url_file": f'database:\n  url_file: "secrets/db{bad}"\nbroker:\n  url: {MQ}\n',
        "broker.tls.ca_file": (
            f'database:\n  url: {DB}\nbroker:\n  url: "amqps://u:p@mq/%2F"\n'
            f'  tls:\n    ca_file: "ca{bad}.pem"\n'
        ),
        "api.token_file": (
            f'database:\n  url: {DB}\nbroker:\n  url: {MQ}\napi:\n  token_file: "t{bad}"\n'
        ),
    }
    return value[key]


@pytest.mark.parametrize("kind", sorted(BAD))
@pytest.mark.parametrize(
    "key",
    ["database.url", "broker.url[0]", "database.url_file", "broker.tls.ca_file", "api.token_file"],
)
def test_a_setting_holding_bad_text_is_refused_naming_its_key(
    tmp_path: Path, key: str, kind: str
) -> None:
    path = tmp_path / "flowforge.yaml"
    path.write_text(yaml_with(key, BAD[kind]))
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    message = str(info.value)
    assert message.startswith(f"{path}: {key}: {REASON[kind]}"), message
    assert "\n" not in message and SECRET not in message, message


@pytest.mark.parametrize(
    ("key", "variable"),
    [
        ("database.url_file", None),
        ("database.password_file", None),
        ("broker.password_file", None),
        (None, "FLOWFORGE_API_TOKEN_FILE"),
    ],
)
def test_a_secret_file_holding_a_nul_byte_is_refused_without_its_content(
    tmp_path: Path, key: str | None, variable: str | None
) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(f"{SECRET}\x00tail\n".encode())
    secret.chmod(0o600)
    database = {"database.url_file": "  url_file: secret\n"}.get(key or "", f"  url: {DB}\n")
    if key == "database.password_file":
        database += "  password_file: secret\n"
    broker = f"  url: {MQ}\n"
    if key == "broker.password_file":
        broker = "  url: amqp://guest@127.0.0.1:5672/%2F\n  password_file: secret\n"
    text = f"database:\n{database}broker:\n{broker}api:\n  listen: 127.0.0.1:0\n"
    path = tmp_path / "flowforge.yaml"
    path.write_text(text)
    env = {variable: str(secret)} if variable else {}
    with pytest.raises(ConfigError) as info:
        load_config(path, env=env)
    message = str(info.value)
    assert f"{key or variable}: cannot use {secret}: holds a NUL byte" in message, message
    assert "\n" not in message and SECRET not in message and "tail" not in message


def test_a_command_on_such_a_config_exits_2_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    for name in [k for k in os.environ if k.startswith(("FLOWFORGE_", "PG"))]:
        monkeypatch.delenv(name)
    path = tmp_path / "flowforge.yaml"
    path.write_text(yaml_with("database.url", BAD["surrogate"]))
    code = main(["-c", str(path), "runs"])
    out, err = capfd.readouterr()
    assert code == exitcodes.USAGE, (code, err)
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    assert err == f"flowforge: {path}: database.url: holds a lone surrogate (not UTF-8 text)\n"


def test_a_workflow_file_holding_a_nul_byte_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "w.yaml"
    path.write_text('name: w\ntasks:\n  - name: a\n    handler: "h\\0"\n')
    workflow, problems = check_file(path)
    assert workflow is None
    assert problems == [f"{path}:4: tasks[0].handler: holds a NUL byte"], problems
