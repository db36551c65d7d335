"""supervisor/residency.py: which mappings' pages the supervisor gives back, and that a process
that gave them back still runs the code in them."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from supervisor import residency

SMAPS = """\
00400000-00420000 r--p 00000000 08:01 1234   /usr/bin/python3.11
Rss:                 100 kB
Anonymous:             0 kB
00420000-00500000 r-xp 00020000 08:01 1234   /usr/bin/python3.11
Rss:                 700 kB
Anonymous:             0 kB
VmFlags: rd ex mr mw me
00700000-00710000 r--p 00300000 08:01 1234   /usr/bin/python3.11
Rss:                  64 kB
Anonymous:            64 kB
00710000-00750000 rw-p 00310000 08:01 1234   /usr/bin/python3.11
Rss:                 256 kB
Anonymous:           128 kB
01000000-02000000 rw-p 00000000 00:00 0      [heap]
Rss:                9000 kB
Anonymous:          9000 kB
7f0000000000-7f0000100000 r-xp 00000000 08:01 99     /usr/lib/libcrypto.so.3
Rss:                3500 kB
Anonymous:             0 kB
7f0000200000-7f0000210000 r--s 00000000 08:01 77     /usr/lib/shared-data
Rss:                  64 kB
Anonymous:             0 kB
7f0000300000-7f0000310000 r--p 00000000 00:01 5      /memfd:flowforge-secrets (deleted)
Rss:                   4 kB
Anonymous:             0 kB
7f0000400000-7f0000410000 r-xp 00000000 08:01 88     /usr/lib/old.so (deleted)
Rss:                  16 kB
Anonymous:             0 kB
7f0000500000-7f0000600000 r-xp 00000000 08:01 66     /usr/lib/untouched.so
Rss:                   0 kB
Anonymous:             0 kB
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0      [stack]
Rss:                  40 kB
Anonymous:            40 kB
"""

#: The ranges of SMAPS that may be dropped: read-only private file mappings with resident,
#: unwritten pages.
DROPPABLE = [(0x400000, 0x20000, 100), (0x420000, 0xE0000, 700), (0x7F0000000000, 0x100000, 3500)]


def test_an_smaps_text_is_read_mapping_by_mapping() -> None:
    found = list(residency.mappings(SMAPS))
    assert len(found) == 11
    crypto = found[5]
    assert (crypto.start, crypto.end, crypto.perms, crypto.path) == (
        0x7F0000000000,
        0x7F0000100000,
        "r-xp",
        "/usr/lib/libcrypto.so.3",
    )
    assert (crypto.rss_kb, crypto.anonymous_kb) == (3500, 0)
    assert found[4].path == "[heap]" and found[4].anonymous_kb == 9000


def test_only_clean_private_read_only_file_pages_are_droppable() -> None:
    droppable = [
        (m.start, m.end - m.start, m.rss_kb) for m in residency.mappings(SMAPS) if m.droppable
    ]
    # not: a relocated (written) read-only range, a writable one, the heap and the stack, a
    # shared mapping, a memfd, a deleted file, a range with nothing resident
    assert droppable == DROPPABLE


def test_each_droppable_range_is_advised_and_its_resident_kb_counted(tmp_path: Path) -> None:
    smaps = tmp_path / "smaps"
    smaps.write_text(SMAPS)
    advised: list[tuple[int, int, int]] = []

    def advise(start: int, length: int, advice: int) -> int:
        advised.append((start, length, advice))
        return -1 if start == 0x420000 else 0  # one refused: not counted

    assert residency.drop_file_pages(str(smaps), advise) == 100 + 3500
    assert advised == [(s, n, residency.MADV_DONTNEED) for s, n, _ in DROPPABLE]


def test_without_smaps_nothing_is_dropped(tmp_path: Path) -> None:
    def advise(start: int, length: int, advice: int) -> int:
        raise AssertionError("nothing to advise")

    assert residency.drop_file_pages(str(tmp_path / "absent"), advise) == 0


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux's /proc only")
def test_a_process_gives_back_its_library_pages_and_still_runs_them() -> None:
    """A real process: OpenSSL loaded and used, its pages given back, then used again."""
    script = textwrap.dedent(
        """
        import hashlib, json, ssl
        from supervisor import residency

        def rss_file_kb():
            for line in open("/proc/self/status"):
                if line.startswith("RssFile:"):
                    return int(line.split()[1])

        ssl.create_default_context()
        before = rss_file_kb()
        dropped = residency.drop_file_pages()
        after = rss_file_kb()
        context = ssl.create_default_context()  # runs OpenSSL's code again: refaulted
        digest = hashlib.sha256(b"flowforge").hexdigest()
        print(json.dumps({"before": before, "after": after, "dropped": dropped,
                          "verify": context.verify_mode == ssl.CERT_REQUIRED,
                          "digest": digest}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=Path(residency.__file__).resolve().parents[1],
    )
    report = json.loads(out.stdout)
    assert report["dropped"] > 1024, report  # libcrypto's and libpython's pages at least
    assert report["after"] < report["before"] - 1024, report
    assert report["verify"] is True
    assert report["digest"] == hashlib.sha256(b"flowforge").hexdigest()
