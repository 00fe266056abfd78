"""The stall watchdog, and `abort`: how a process ends a run it cannot finish.

`Watchdog(timeout_s)`: the trainer beats after every step it dispatches and every checkpoint
it saves; a background thread that sees no beat for `timeout_s` prints every thread's stack
(the stuck collective, data read or lock is in there), then aborts with a message that names
the process's ranks. A process stuck in a collective cannot be unwound by an exception, so it
ends with `os._exit`; the launchers then end the other ranks (torch: the spawning process; jax:
the peers watching the distributed store). A faulthandler timer armed a little later is the
backstop for the one case the thread cannot act in: a thread holding the GIL forever.

`abort(message)` prints `hstu: error: <message>` to stderr, runs the hooks a launcher registered
(`add_abort_hook`: how this process tells the others, e.g. a message file for the torch spawner
or a key in the jax distributed store) and ends the process.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import NoReturn

EXIT_ABORT = 1
_hooks: list[Callable[[str], None]] = []
_aborting = threading.Lock()


def add_abort_hook(hook: Callable[[str], None]) -> None:
    """`hook(message)` runs in `abort`, before the process ends (errors in it are ignored)."""
    _hooks.append(hook)


def remove_abort_hook(hook: Callable[[str], None]) -> None:
    if hook in _hooks:
        _hooks.remove(hook)


def abort(message: str, code: int = EXIT_ABORT) -> NoReturn:
    """Print `hstu: error: message`, run the abort hooks, end the process now. Only the first
    caller does: a second thread that aborts meanwhile waits for the end."""
    if not _aborting.acquire(blocking=False):
        threading.Event().wait()
    with contextlib.suppress(OSError, ValueError):
        print(f"hstu: error: {message}", file=sys.stderr, flush=True)
    for hook in list(_hooks):
        with contextlib.suppress(Exception):  # best effort: the process ends either way
            hook(message)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def format_all_stacks() -> str:
    """Every live thread's Python stack, named."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame))
        parts.append(f'Thread "{names.get(ident, "?")}" ({ident}):\n{stack}')
    return "\n".join(parts)


def _raw_stderr():
    """A stream with a file descriptor, for faulthandler (pytest may replace sys.stderr)."""
    for stream in (sys.stderr, sys.__stderr__):
        try:
            stream.fileno()
            return stream
        except (AttributeError, OSError, ValueError):
            continue
    return None


class Watchdog:
    """Aborts the process when `beat()` was not called for `timeout_s` seconds (0: never)."""

    _backstop_owner: Watchdog | None = None  # faulthandler's timer is one per process

    def __init__(self, timeout_s: float, where: str = "this process"):
        self.timeout_s, self.where = float(timeout_s), where
        self._last = time.monotonic()
        self._armed = -float("inf")  # when the faulthandler backstop was last re-armed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Watchdog:
        if self.timeout_s > 0 and self._thread is None:
            self.beat()
            self._thread = threading.Thread(target=self._run, name="hstu-watchdog", daemon=True)
            self._thread.start()
        return self

    def beat(self) -> None:
        self._last = time.monotonic()
        # Re-arming starts a thread: at most every timeout / 10 s, well inside the grace.
        if self.timeout_s > 0 and self._last - self._armed > self.timeout_s / 10:
            self._armed = self._last
            self._arm_backstop()

    def stop(self) -> None:
        self._stop.set()
        if Watchdog._backstop_owner is self:
            faulthandler.cancel_dump_traceback_later()
            Watchdog._backstop_owner = None

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _arm_backstop(self) -> None:
        stream = _raw_stderr()
        if stream is None:
            return
        grace = max(30.0, self.timeout_s / 2)
        faulthandler.dump_traceback_later(self.timeout_s + grace, exit=True, file=stream)
        Watchdog._backstop_owner = self

    def _run(self) -> None:
        poll = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(poll):
            idle = time.monotonic() - self._last
            if idle < self.timeout_s:
                continue
            with contextlib.suppress(OSError, ValueError):
                print(
                    f"hstu watchdog: no training step finished on {self.where} for {idle:.0f} s; "
                    f"the stack of every thread:\n{format_all_stacks()}",
                    file=sys.stderr,
                    flush=True,
                )
            abort(
                f"watchdog: no training step finished on {self.where} for {idle:.0f} s "
                f"(train.watchdog_s={self.timeout_s:g}); every thread's stack is printed above. "
                "A rank may be stuck in a collective, a data read or a lock; set "
                "train.watchdog_s=0 to turn the watchdog off"
            )
