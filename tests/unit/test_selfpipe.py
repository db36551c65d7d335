"""``supervisor.selfpipe.signal_pipe``: signals as bytes on a pipe, and everything put back.

Real signals to this process (SIGUSR1/SIGUSR2, whose default action would end it) and a real
pipe; every wait is bounded.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

import pytest

from flowforge.roles.signals import stop_on_signals
from supervisor import osapi
from supervisor.selfpipe import SignalPipe, signal_pipe

WAIT_S = 5.0


def _open_fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def _wakeup_fd() -> int:
    current = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(current)
    return current


def _read_until(pipe: SignalPipe, count: int) -> list[int]:
    """Read the pipe until ``count`` signals came, for at most WAIT_S seconds."""
    got: list[int] = []
    deadline = time.monotonic() + WAIT_S
    while len(got) < count and time.monotonic() < deadline:
        arrived = pipe.read(0.1)
        assert arrived is not None
        got += arrived
    return got


def test_a_signal_inside_the_block_is_read_from_the_pipe_not_acted_on() -> None:
    with signal_pipe([signal.SIGUSR1, signal.SIGUSR2]) as pipe:
        assert pipe.read(0) == []  # nothing yet: no wait
        os.kill(os.getpid(), signal.SIGUSR1)  # its default action would end this process
        os.kill(os.getpid(), signal.SIGUSR2)
        assert _read_until(pipe, 2) == [signal.SIGUSR1, signal.SIGUSR2]


def test_leaving_puts_back_the_handlers_and_the_wakeup_fd_and_closes_the_pipe() -> None:
    before_fds, before_wakeup = _open_fds(), _wakeup_fd()
    before = signal.getsignal(signal.SIGUSR1)
    with signal_pipe([signal.SIGUSR1]) as pipe:
        assert signal.getsignal(signal.SIGUSR1) is not before
        assert _wakeup_fd() == pipe.write_fd
        assert {pipe.read_fd, pipe.write_fd} <= _open_fds()
    assert signal.getsignal(signal.SIGUSR1) is before
    assert _wakeup_fd() == before_wakeup
    assert _open_fds() == before_fds  # both ends closed


def test_a_handler_that_cannot_be_installed_undoes_the_ones_before_it() -> None:
    before_fds, before_wakeup = _open_fds(), _wakeup_fd()
    before = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(OSError), signal_pipe([signal.SIGUSR1, signal.SIGKILL]):
        pytest.fail("entered a block whose signals could not all be handled")
    assert signal.getsignal(signal.SIGUSR1) is before
    assert _wakeup_fd() == before_wakeup
    assert _open_fds() == before_fds


def test_the_reader_sees_the_signal_then_end_of_file_and_is_joined_before_the_read_closes() -> None:
    seen: list[int] = []
    ended = threading.Event()
    closed_read_end_while_reading: list[bool] = []

    def reader(pipe: SignalPipe) -> None:
        while (arrived := pipe.read(None)) is not None:
            seen.extend(arrived)
        # the write end is closed; the read end must still be open for this last look
        try:
            os.fstat(pipe.read_fd)
        except OSError:
            closed_read_end_while_reading.append(True)
        ended.set()

    with signal_pipe([signal.SIGUSR1], reader=reader):
        os.kill(os.getpid(), signal.SIGUSR1)
        assert _until(lambda: signal.SIGUSR1 in seen)
    assert ended.is_set(), "the reader was not joined on the way out"
    assert not closed_read_end_while_reading


def _until(condition: Callable[[], bool]) -> bool:
    """Poll ``condition`` every 50 ms for at most WAIT_S seconds."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_stop_on_signals_sets_the_event_and_leaves_no_thread_behind() -> None:
    stop = threading.Event()
    threads = set(threading.enumerate())
    with stop_on_signals(stop, [signal.SIGUSR1]):
        assert not stop.is_set()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.wait(WAIT_S)
    assert set(threading.enumerate()) <= threads


def test_the_supervisors_os_seam_reads_its_handled_signals_from_the_pipe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # not in the test process: orphans would be reparented to pytest for the rest of the run
    monkeypatch.setattr(osapi, "set_child_subreaper", lambda: None)
    system = osapi.RealOs()
    before_fds = _open_fds()
    with system.supervising([signal.SIGUSR1]):
        assert system.wait_for_signals(0) == []
        os.kill(os.getpid(), signal.SIGUSR1)
        got: list[int] = []
        assert _until(lambda: bool(got.extend(system.wait_for_signals(0.05)) or got))
        assert got == [signal.SIGUSR1]
    assert _open_fds() == before_fds
    with pytest.raises(RuntimeError, match="outside supervising"):
        system.wait_for_signals(0)


def test_a_signal_blocked_before_the_pipe_existed_arrives_once_it_does() -> None:
    """``flowforge up`` blocks SIGTERM and SIGINT until the supervisor's pipe exists: one that
    came meanwhile was pending, and the pipe unblocks and reads it."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
    try:
        # to this thread, which blocks it (a process-directed signal could go to another
        # thread of the test process, e.g. pytest-xdist's, whose default action would end it)
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)
        assert signal.SIGUSR1 in signal.sigpending()
        with signal_pipe([signal.SIGUSR1]) as pipe:
            assert signal.SIGUSR1 not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
            assert _read_until(pipe, 1) == [signal.SIGUSR1]
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def test_a_signal_of_another_python_handler_is_not_a_stop() -> None:
    """``set_wakeup_fd`` writes every signal that has a Python handler to the pipe: a
    handler's own (SIGUSR1 here, say a ``signal.alarm`` of its own) must not stop the role;
    one of the stop signals still does."""
    stop = threading.Event()
    handled = threading.Event()
    before = signal.signal(signal.SIGUSR1, lambda *_: handled.set())
    try:
        with stop_on_signals(stop, [signal.SIGUSR2]):
            os.kill(os.getpid(), signal.SIGUSR1)
            assert handled.wait(WAIT_S)
            # the watcher has had the byte as soon as the signal arrived: an absence, bounded
            assert not stop.wait(0.3)
            os.kill(os.getpid(), signal.SIGUSR2)
            assert stop.wait(WAIT_S)
    finally:
        signal.signal(signal.SIGUSR1, before)
