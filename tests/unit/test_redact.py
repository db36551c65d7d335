"""``redact_url``: no secret of any URL shape FlowForge prints or logs survives it.

Generated passwords go through every place a URL can carry one: the userinfo of a
``postgresql://`` or ``amqp://`` URL (percent-encoded or raw), ``password=`` / ``sslpassword=``
query parameters, a comma-separated broker list, a multi-host libpq URL and a libpq
``key=value`` string (quoted or not). The hosts stay visible so the output is still useful.
"""

from __future__ import annotations

from urllib.parse import quote

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowforge.config import redact_url

#: Passwords start with a marker no fixed part of the URLs below contains.
MARK = "Zq"
secrets = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=0, max_size=24
).map(lambda s: MARK + s)
#: Raw (not percent-encoded) passwords as people paste them, with URL-special characters.
raw_secrets = st.text(
    st.sampled_from("abcXYZ019!$()*+-._~@:/?#[]=;'\"%"), min_size=0, max_size=16
).map(lambda s: MARK + s)
schemes = st.sampled_from(["postgresql", "postgres", "amqp", "amqps"])
secret_params = st.sampled_from(
    ["password", "sslpassword", "PASSWORD", "Password", "oauth_client_secret", "access_token"]
)


def enc(text: str) -> str:
    return quote(text, safe="")


def assert_redacted(url: str, secret: str, *visible: str) -> None:
    out = redact_url(url)
    assert secret not in out, (url, out)
    assert enc(secret) not in out, (url, out)
    assert "***" in out
    for part in visible:
        assert part in out, (url, out, part)


@given(schemes, secrets)
def test_the_password_of_the_userinfo(scheme: str, secret: str) -> None:
    url = f"{scheme}://ff:{enc(secret)}@db.example:5432/flowforge?sslmode=require"
    assert_redacted(url, secret, "ff:***@db.example:5432/flowforge", "sslmode=require")


@given(schemes, raw_secrets)
def test_a_raw_password_with_url_special_characters(scheme: str, secret: str) -> None:
    url = f"{scheme}://ff:{secret}@db.example:5432/flowforge"
    assert_redacted(url, secret, "db.example:5432/flowforge")


@given(schemes, secret_params, secrets, st.booleans())
def test_a_secret_query_parameter(scheme: str, name: str, secret: str, first: bool) -> None:
    query = f"{name}={enc(secret)}&application_name=ff"
    if not first:
        query = f"sslmode=verify-full&{query}"
    url = f"{scheme}://ff@db.example/flowforge?{query}"
    assert_redacted(url, secret, "ff@db.example/flowforge", "application_name=ff")


@given(st.lists(st.tuples(secrets, secrets), min_size=1, max_size=4), st.sampled_from([",", ", "]))
def test_a_comma_separated_broker_list(pairs: list[tuple[str, str]], sep: str) -> None:
    nodes = [
        f"amqp://u{i}:{enc(pw)}@mq{i}:5672/%2F?password={enc(qp)}"
        for i, (pw, qp) in enumerate(pairs)
    ]
    out = redact_url(sep.join(nodes))
    for i, (pw, qp) in enumerate(pairs):
        assert enc(pw) not in out and enc(qp) not in out, out
        assert f"u{i}:***@mq{i}:5672/%2F?password=***" in out


@given(secrets)
def test_a_multi_host_libpq_url(secret: str) -> None:
    url = f"postgresql://ff:{enc(secret)}@db1:5432,db2:5433/flowforge?target_session_attrs=any"
    assert_redacted(url, secret, "ff:***@db1:5432,db2:5433/flowforge?target_session_attrs=any")


@given(secrets.filter(lambda s: not any(c.isspace() or c in "'\\" for c in s)), secret_params)
def test_a_libpq_key_value_string(secret: str, name: str) -> None:
    assert_redacted(f"host=db port=5432 {name}={secret} dbname=ff", secret, "host=db", "dbname=ff")


@given(secrets)
def test_a_quoted_key_value_password(secret: str) -> None:
    quoted = secret.replace("\\", "\\\\").replace("'", "\\'")
    url = f"host=db password = '{quoted} with blanks' sslpassword='{quoted}' dbname=ff"
    out = redact_url(url)
    assert secret not in out and "with blanks" not in out, out
    assert "host=db" in out and "dbname=ff" in out


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://db.example:5432/flowforge",
        "amqp://guest@127.0.0.1:5672/%2F",
        "postgresql://ff@db/x?sslmode=require&application_name=ff",
        "host=db port=5432 dbname=ff",
        "not a url",
    ],
)
def test_a_url_without_secrets_is_unchanged(url: str) -> None:
    assert redact_url(url) == url


@settings(max_examples=50)
@given(st.text(max_size=60))
def test_anything_at_all_is_redacted_without_error(text: str) -> None:
    assert isinstance(redact_url(text), str)
