"""Certificate and key paths of the configuration, made absolute against the config file's
directory — the rule ``workflows`` and handler modules follow — so a config folder that holds
its certificates works whatever directory FlowForge starts in.

Left alone, libpq would read a relative ``sslrootcert`` against the process's working directory,
which is the operator's shell in one place, ``/`` under systemd and the image's ``WORKDIR`` in a
container. Paths are joined, not resolved: a symbolic link (how Kubernetes and many rotation
tools swap certificates) stays a link, read anew at every connection.

Nothing here reads a file: whether a file exists and parses is the connection's business, and
a failure there is reported as a configuration error (flowforge/store/pgerrors.py,
flowforge/broker/tls.py). Only a private key's mode is looked at, for a warning.
"""

from __future__ import annotations

import os
import stat

#: libpq connection parameters that name a file or a directory (PostgreSQL's libpq manual,
#: "Parameter Key Words").
DATABASE_FILE_PARAMS = ("sslrootcert", "sslcert", "sslkey", "sslcrl", "sslcrldir")
#: ``sslrootcert=system`` (libpq 16+) means the system's trusted roots, not a file.
_SYSTEM_ROOTS = "system"


def absolute(path: str, base_dir: str) -> str:
    """``path`` itself if absolute, else joined to ``base_dir`` (not resolved: links stay)."""
    return path if os.path.isabs(path) else os.path.join(base_dir, path)


def database_url(url: str, base_dir: str) -> str:
    """``url`` with every relative file parameter (:data:`DATABASE_FILE_PARAMS`) made absolute
    against ``base_dir``; ``url`` unchanged if it has none.

    A URL that needs a change comes back as a libpq ``key=value`` string (psycopg's
    ``make_conninfo``), equivalent to the URL. A URL libpq cannot parse comes back unchanged: it
    is refused, without being echoed, where it is used (``pgerrors.check_url``).
    """
    lowered = url.lower()
    if not any(name in lowered for name in DATABASE_FILE_PARAMS):
        return url  # the common case, without importing the driver
    import psycopg
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    try:
        params = conninfo_to_dict(url)
    except psycopg.Error:
        return url
    changed = {}
    for name in DATABASE_FILE_PARAMS:
        value = str(params.get(name) or "")
        if name == "sslrootcert" and value == _SYSTEM_ROOTS:
            continue
        if value and not os.path.isabs(value):
            changed[name] = absolute(value, base_dir)
    return make_conninfo(url, **changed) if changed else url


def open_key_warning(name: str, path: str) -> str | None:
    """A warning if the private key ``path`` (config key ``name``) is readable by group or
    others, like a secret file's (flowforge/secretfiles.py); None if not, or if it cannot be
    looked at (the connection says why). libpq refuses such a key itself; Python's ``ssl``
    does not, hence the warning for the broker's."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if not mode & (stat.S_IRGRP | stat.S_IROTH):
        return None
    return (
        f"{name}: private key {path} is readable by group or others"
        f" (mode {stat.S_IMODE(mode):04o}): make it 0400 or 0600, owned by the user"
        " FlowForge runs as"
    )
