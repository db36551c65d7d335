"""Reading the YAML files FlowForge is given (the config, workflow files): one loader for both.

PyYAML's ``safe_load`` keeps the last of two equal keys in a mapping without a word, so a
repeated ``retry:`` or ``database:`` silently replaces the first. :func:`load` refuses them:
every duplicate key is a problem with its line. A syntax error keeps the parser's own reason
and position. The document's node tree is kept so a key path (``tasks[1].retry``) can be
turned back into the line an error is about.

PyYAML is imported when a file is first parsed, not with this module: the supervisor
``flowforge up`` becomes imports the config's modules and reads no YAML (the config crosses
its exec already read, flowforge/tree.py), and every child it forks would inherit PyYAML's
objects whether or not its role reads a YAML file (docs/performance.md, "PyYAML out of the
supervisor").
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import yaml

_MERGE_TAG = "tag:yaml.org,2002:merge"
_SEGMENT = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


class YamlError(ValueError):
    """The text is not valid YAML; ``str()`` is the parser's reason, ``line`` 1-based or None."""

    def __init__(self, message: str, line: int | None, column: int | None = None) -> None:
        super().__init__(message)
        self.line = line
        self.column = column

    @property
    def where(self) -> str:
        """``:line:column`` (or ``:line``, or nothing) to append to a file name."""
        if self.line is None:
            return ""
        return f":{self.line}" + (f":{self.column}" if self.column is not None else "")


class YamlFileError(ValueError):
    """A YAML file cannot be read or parsed. ``str()`` is one line that names the file (and the
    line and column when the parser knows them): ``x.yaml:3:5: not valid YAML: ...``."""


@functools.cache
def _loader_class() -> type[Any]:
    """``SafeLoader`` that records every duplicate key (merge keys ``<<`` excepted); made at
    the first parse (module doc)."""
    import yaml

    class Loader(yaml.SafeLoader):
        def __init__(self, stream: str) -> None:
            super().__init__(stream)
            self.duplicates: list[tuple[int, str]] = []

        def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
            seen: dict[tuple[str, str], int] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == _MERGE_TAG:
                    continue
                line, key = key_node.start_mark.line + 1, (key_node.tag, key_node.value)
                if key in seen:
                    self.duplicates.append(
                        (line, f"duplicate key {key_node.value!r} (first at line {seen[key]})")
                    )
                else:
                    seen[key] = line
            return super().construct_mapping(node, deep)

    return Loader


@dataclass(frozen=True)
class Document:
    """A parsed YAML document: its data, node tree and duplicate keys as (line, message)."""

    data: Any
    node: yaml.Node | None
    duplicates: tuple[tuple[int, str], ...] = field(default=())

    def line_of(self, path: str) -> int | None:
        """The 1-based line of the key at ``path`` (``a.b[2].c``), or of the deepest part of
        it that exists; None without a document."""
        import yaml  # imported already: the document was parsed

        node, line = self.node, None
        for key, index in _SEGMENT.findall(path):
            if isinstance(node, yaml.MappingNode) and key:
                # the last pair: merged (<<) pairs are put first, and an explicit key wins
                found = [p for p in node.value if getattr(p[0], "value", None) == key]
                pair = found[-1] if found else None
                if pair is None:
                    break
                line, node = pair[0].start_mark.line + 1, pair[1]
            elif isinstance(node, yaml.SequenceNode) and index and int(index) < len(node.value):
                node = node.value[int(index)]
                line = node.start_mark.line + 1
            else:
                break
        if line is None and self.node is not None:
            line = self.node.start_mark.line + 1
        return line


def load(text: str) -> Document:
    """Parse one YAML document; raise :class:`YamlError` with the parser's reason and position."""
    import yaml

    loader = _loader_class()(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        reason = " ".join(str(p) for p in (exc.problem, exc.context and f"({exc.context})") if p)
        raise YamlError(
            reason or "not valid YAML",
            mark.line + 1 if mark else None,
            mark.column + 1 if mark else None,
        ) from exc
    except yaml.YAMLError as exc:
        raise YamlError(" ".join(str(exc).split()), None) from exc
    finally:
        loader.dispose()
    return Document(data, node, tuple(sorted(loader.duplicates)))


def read(path: Path, what: str) -> Document:
    """Read the UTF-8 file ``path`` and parse it with :func:`load` (duplicate keys are left in
    :attr:`Document.duplicates` for the caller to judge).

    ``what`` names the file's kind in the message (``config file``, ``workflow file``); a file
    that cannot be read or parsed raises :class:`YamlFileError`.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise YamlFileError(f"{path}: cannot read {what}: {reason or exc}") from exc
    try:
        return load(text)
    except YamlError as exc:
        raise YamlFileError(f"{path}{exc.where}: not valid YAML: {exc}") from exc
