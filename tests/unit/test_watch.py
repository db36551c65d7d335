"""The polling watcher of ``flowforge dev`` (flowforge/watch.py): what a scan sees, what counts
as a change, and how a burst of writes becomes one report (debounce)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flowforge.watch import Snapshot, Watcher, WatchSet, changed, scan


def _write(path: Path, text: str = "x = 1\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_a_scan_sees_sources_under_the_folders_and_skips_caches_hidden_and_virtualenvs(
    tmp_path: Path,
) -> None:
    wanted = [
        _write(tmp_path / "handlers.py"),
        _write(tmp_path / "pkg" / "mod.py"),
        _write(tmp_path / "workflows" / "a.yaml"),
        _write(tmp_path / "workflows" / "b.yml"),
    ]
    _write(tmp_path / "notes.txt")
    _write(tmp_path / "__pycache__" / "handlers.py")
    _write(tmp_path / ".git" / "hook.py")
    _write(tmp_path / "env" / "pyvenv.cfg", "home = /usr\n")
    _write(tmp_path / "env" / "lib" / "site.py")
    _write(tmp_path / ".flowforge-dev" / "x.py")
    _write(tmp_path / "state" / "y.py")
    found = scan(WatchSet(dirs=(tmp_path,), excluded=(tmp_path / "state",)))
    assert sorted(found) == sorted(wanted)


def test_a_listed_file_is_watched_even_before_it_exists(tmp_path: Path) -> None:
    watch = WatchSet(files=(tmp_path / "later.py",))
    before = scan(watch)
    assert before == {}
    after = scan(WatchSet(files=(_write(tmp_path / "later.py"),)))
    assert changed(before, after) == {tmp_path / "later.py"}


def test_a_scan_stops_at_its_limit(tmp_path: Path) -> None:
    for i in range(5):
        _write(tmp_path / f"m{i}.py")
    assert len(scan(WatchSet(dirs=(tmp_path,)), limit=3)) == 3


def test_creation_removal_modification_and_replacement_are_changes(tmp_path: Path) -> None:
    kept = _write(tmp_path / "kept.py")
    edited = _write(tmp_path / "edited.py", "v = 1\n")
    removed = _write(tmp_path / "removed.py")
    replaced = _write(tmp_path / "replaced.py", "same\n")
    watch = WatchSet(dirs=(tmp_path,))
    before = scan(watch)
    stamp = os.stat(edited).st_mtime_ns
    edited.write_text("v = 2\n")  # the same size: only the time tells
    os.utime(edited, ns=(stamp + 1_000_000, stamp + 1_000_000))
    removed.unlink()
    created = _write(tmp_path / "created.py")
    # an editor's save by rename: a new inode, whatever the time and size say
    staged = _write(tmp_path / "replaced.py.tmp", "same\n")
    stamp = os.stat(replaced).st_mtime_ns
    os.utime(staged, ns=(stamp, stamp))
    os.replace(staged, replaced)
    assert changed(before, scan(watch)) == {edited, removed, created, replaced}
    assert kept not in changed(before, scan(watch))


class Files:
    """A scripted scan and clock: each poll sees ``snapshot`` at ``now``."""

    def __init__(self) -> None:
        self.snapshot: dict[Path, tuple[int, int, int]] = {Path("a.py"): (1, 1, 1)}
        self.now = 0.0

    def scan(self) -> Snapshot:
        return dict(self.snapshot)

    def touch(self, name: str) -> None:
        old = self.snapshot.get(Path(name), (0, 0, 0))
        self.snapshot[Path(name)] = (old[0] + 1, old[1], old[2])

    def at(self, seconds: float, watcher: Watcher) -> frozenset[Path]:
        self.now = seconds
        return watcher.poll()


@pytest.fixture
def files() -> Files:
    return Files()


def test_nothing_is_reported_without_a_change(files: Files) -> None:
    watcher = Watcher(files.scan, lambda: files.now)
    assert [files.at(t, watcher) for t in (0.5, 1.0, 1.5)] == [frozenset()] * 3


def test_a_change_is_reported_once_the_files_have_been_quiet(files: Files) -> None:
    watcher = Watcher(files.scan, lambda: files.now, quiet_s=0.3)
    files.touch("a.py")
    assert files.at(0.5, watcher) == frozenset()  # just seen: the save may go on
    assert files.at(1.0, watcher) == {Path("a.py")}
    assert files.at(1.5, watcher) == frozenset()  # reported once


def test_a_burst_of_writes_to_several_files_is_one_report(files: Files) -> None:
    watcher = Watcher(files.scan, lambda: files.now, quiet_s=0.3, max_wait_s=5.0)
    files.touch("a.py")
    assert files.at(0.5, watcher) == frozenset()
    files.touch("a.py")
    files.touch("b.py")
    assert files.at(0.7, watcher) == frozenset()
    files.touch("c.py")
    assert files.at(0.9, watcher) == frozenset()
    assert files.at(1.3, watcher) == {Path("a.py"), Path("b.py"), Path("c.py")}


def test_files_that_never_settle_are_reported_at_the_longest_wait(files: Files) -> None:
    watcher = Watcher(files.scan, lambda: files.now, quiet_s=0.3, max_wait_s=2.0)
    reports = []
    for step in range(1, 12):  # a change at every poll, 0.25 s apart
        files.touch("a.py")
        reports.append(files.at(step * 0.25, watcher))
    assert reports.index({Path("a.py")}) == 8  # first seen at 0.25 s, reported at 2.25 s
    assert sum(1 for r in reports if r) == 1


@pytest.mark.parametrize(("quiet_s", "max_wait_s"), [(-0.1, 1.0), (2.0, 1.0)])
def test_a_debounce_that_cannot_be_is_refused(quiet_s: float, max_wait_s: float) -> None:
    with pytest.raises(ValueError):
        Watcher(dict, lambda: 0.0, quiet_s=quiet_s, max_wait_s=max_wait_s)
