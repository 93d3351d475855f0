"""Signals that ask a command to stop, and helper processes that end with the process they work for. Torch-free.

SIGTERM (`kill PID`, a job wrapper, a CI timeout) and SIGHUP (a closed terminal) end a Python process at once: no
`finally` runs, so its temporary files stay and the processes it started live on with parent pid 1. `raise_on`
turns them into `Interrupted`, a KeyboardInterrupt, so that they unwind like Ctrl-C does (llmctl.errors reports
"interrupted (SIGTERM)" and exits with 128 + the signal). SIGKILL cannot be caught: a helper process (a pool worker)
calls `exit_with(parent)` to end as soon as its parent is gone, however it went.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from collections.abc import Iterator


class Interrupted(KeyboardInterrupt):
    """A stop signal other than Ctrl-C, raised where Ctrl-C's KeyboardInterrupt would be."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # what a shell reports for a process that the signal ended


@contextlib.contextmanager
def raise_on(*signals: signal.Signals) -> Iterator[None]:
    """Within the block (main thread only), each of `signals` raises Interrupted; a second one while the first
    unwinds ends the process at once, as it would have without the block."""

    def handler(signum: int, frame: object) -> None:
        for s in signals:
            signal.signal(s, signal.SIG_DFL)
        raise Interrupted(signum)

    saved = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, old in saved.items():
            signal.signal(s, old)


PARENT_POLL_S = 0.5
"""How often a helper looks for its parent where the kernel cannot tell it (no pidfd: not Linux, or before 5.3)."""


def exit_with(parent: int) -> None:
    """In a helper process: end it (os._exit, no cleanup: its parent owned everything) as soon as process `parent`
    is gone. A daemon thread waits on a pidfd of the parent (readable when it exits, Linux >= 5.3), else polls."""
    threading.Thread(target=_watch, args=(parent,), name="llmctl-exit-with-parent", daemon=True).start()


def _watch(parent: int) -> None:
    try:
        fd = os.pidfd_open(parent)  # type: ignore[attr-defined]  # Linux only
    except ProcessLookupError:
        os._exit(1)  # already gone
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        select.select([fd], [], [])
        os._exit(1)
    while True:
        try:
            os.kill(parent, 0)
        except ProcessLookupError:
            os._exit(1)
        except PermissionError:
            pass  # exists
        time.sleep(PARENT_POLL_S)
