"""Secrets read from files: the ``*_file`` config keys and ``FLOWFORGE_*_FILE`` variables.

What systemd's ``LoadCredential=`` (``$CREDENTIALS_DIRECTORY/NAME``), podman and Docker secrets
(``/run/secrets/NAME``) and Kubernetes secret volumes give a service is a file holding the
secret. Pointing FlowForge at that file keeps the secret out of the config file, out of the
environment (which every child inherits and ``/proc/PID/environ`` shows), out of command lines
and so out of ``ps``. The rules (README, "Secrets from files"):

- the file holds the secret as UTF-8 text; one trailing newline (``\\n`` or ``\\r\\n``) is
  removed, because ``echo`` and editors add one; an empty file is an error;
- it must be a regular file of at most :data:`MAX_BYTES`: ``flowforge up`` reads its config
  twice (it checks it, then becomes the tree, which reads it again), so a pipe such as
  ``<(pass show db)`` would be empty the second time; a device or a FIFO could block forever;
- a file readable by group or others is used, with a warning: podman and Docker Swarm mount
  secrets with mode 0444 and Kubernetes with 0644 by default, readable by nobody else in a
  container of one user, so refusing would break the very setups this exists for;
- an error names who pointed at the file, its path and the reason, never a byte of its content.

Nothing here reads the environment: :mod:`flowforge.config` says where each secret comes from.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from flowforge.errors import ConfigError

#: The largest secret file read; anything bigger is not a password, token or URL list.
MAX_BYTES = 64 * 1024
#: Mode bits that let someone other than the owner read a file.
OTHERS_READ = stat.S_IRGRP | stat.S_IROTH
#: A ``password`` parameter: in a URL query, or a libpq ``key=value`` string.
_PASSWORD_PARAM = re.compile(r"(?:^|[?&\s])password\s*=")


@dataclass(frozen=True)
class Given:
    """One way a secret can be set: ``name`` (a config key or an environment variable) and
    what it holds, the secret itself (``is_file`` False) or the path of a file holding it."""

    name: str
    text: str | None
    is_file: bool = False


@dataclass(frozen=True)
class Secret:
    """A secret and where it came from; ``warning`` is set when its file's mode is too open."""

    text: str
    source: str
    path: Path | None = None
    warning: str | None = None


def choose(*layers: tuple[Given, ...]) -> Given | None:
    """The first layer that sets the secret, in precedence order (the environment's first).

    Within one layer at most one way may be used: a value and its ``*_file`` together are an
    error naming both, since either could have been meant.
    """
    for layer in layers:
        given = [g for g in layer if g.text]
        if len(given) > 1:
            names = " and ".join(g.name for g in given)
            raise ConfigError(f"{names} are both set: set one of them")
        if given:
            return given[0]
    return None


def resolve(given: Given, base_dir: str | os.PathLike[str], *, multiline: bool = False) -> Secret:
    """The secret ``given`` names: its value, or the content of its file (a relative path is
    under ``base_dir``). ``multiline`` allows a secret of several lines (a list of URLs)."""
    assert given.text is not None
    if not given.is_file:
        return Secret(given.text, given.name)
    path = Path(base_dir, given.text)
    text, mode = read(path, given.name, multiline=multiline)
    warning = None
    if mode & OTHERS_READ:
        warning = (
            f"{given.name}: secret file {path} is readable by group or others"
            f" (mode {stat.S_IMODE(mode):04o}): make it 0400 or 0600, owned by the user"
            " FlowForge runs as"
        )
    return Secret(text, given.name, path, warning)


def read(path: Path, name: str, *, multiline: bool = False) -> tuple[str, int]:
    """The text of the secret file ``path`` and its mode; :class:`ConfigError` naming ``name``,
    the path and the reason otherwise (never the content)."""

    def refused(reason: str | None) -> ConfigError:
        return ConfigError(f"{name}: cannot use {path}: {reason or 'unreadable'}")

    try:
        data, mode = _read_regular_file(path)
    except OSError as exc:
        raise refused(exc.strerror) from None
    if len(data) > MAX_BYTES:
        raise refused(f"larger than {MAX_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise refused("not UTF-8 text") from None
    text = text[:-2] if text.endswith("\r\n") else text.removesuffix("\n")
    if not text:
        raise refused("is empty")
    if "\x00" in text:  # libpq and URLs would cut the secret at it and use what is left
        raise refused("holds a NUL byte")
    if not multiline and ("\n" in text or "\r" in text):
        raise refused("holds more than one line")
    return text, mode


def _read_regular_file(path: Path) -> tuple[bytes, int]:
    """Up to ``MAX_BYTES + 1`` bytes of ``path`` and its mode; ``OSError`` when it cannot be
    opened or is not a regular file (``strerror`` says why)."""
    # O_NONBLOCK: opening a FIFO with no writer would wait for one; fstat refuses it next
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            reason = "is a directory" if stat.S_ISDIR(mode) else "not a regular file"
            raise OSError(errno.EINVAL, reason)
        data = b""
        while len(data) <= MAX_BYTES:
            chunk = os.read(fd, MAX_BYTES + 1 - len(data))
            if not chunk:
                break
            data += chunk
        return data, mode
    finally:
        os.close(fd)


# ------------------------------------------------------------------ passwords into URLs


def userinfo(url: str) -> tuple[str, str | None] | None:
    """``(user, password)`` of a ``scheme://user:password@host`` URL, still percent-encoded;
    None when the URL has no userinfo (or is not a URL)."""
    _, sep, rest = url.partition("://")
    if not sep:
        return None
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    at = authority.rfind("@")
    if at < 0:
        return None
    user, colon, password = authority[:at].partition(":")
    return user, (password if colon else None)


def pg_holds_password(url: str) -> bool:
    """Whether a PostgreSQL URL or libpq ``key=value`` string already carries a password."""
    found = userinfo(url)
    return bool(found and found[1] is not None) or bool(_PASSWORD_PARAM.search(url))


def pg_with_password(url: str, password: str) -> str:
    """``url`` (a ``postgresql://`` URL or a libpq ``key=value`` string) with ``password``
    added as its ``password`` parameter, encoded so libpq reads it back exactly."""
    if "://" in url:
        separator = "" if url.endswith(("?", "&")) else ("&" if "?" in url else "?")
        return f"{url}{separator}password={quote(password, safe='')}"
    quoted = password.replace("\\", "\\\\").replace("'", "\\'")
    return f"{url} password='{quoted}'".lstrip()


def amqp_with_password(url: str, password: str) -> str:
    """``amqp://user@host/...`` with ``password`` put in its userinfo (percent-encoded, which
    pika decodes). The URL must name a user and hold no password (see :func:`userinfo`)."""
    scheme, _, rest = url.partition("://")
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    at = authority.rfind("@")
    return f"{scheme}://{rest[:at]}:{quote(password, safe='')}@{rest[at + 1 :]}"
