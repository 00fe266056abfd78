"""Multi-process JAX: each process learns quickly that another one failed, and why.

Without this, a process whose batch is bad prints its error and then waits in the
`jax.distributed` shutdown barrier while the others wait in a collective, until timeouts minutes
later. Here a failing process publishes its message in the distributed key-value store and ends
at once (`fail`); every process runs a `PeerMonitor` thread that polls the store and ends its
own process with that message (naming the failed process) within a poll interval, whatever its
main thread is blocked in. A process that dies without a word (killed) is named by its stopped
heartbeat counter when a collective fails on the survivors (gloo notices the closed connection
at once); where nothing fails (NCCL waits), the JAX service's own heartbeat timeout
(`dist.heartbeat_s`) ends the survivors, naming the dead task. A dead coordinator (process 0)
ends the others through the JAX client at once.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
import traceback

from hstu.errors import HSTUError
from hstu.launch_checks import config_differences, config_mismatch_error
from hstu.watchdog import abort

FAILED, BEAT, CONFIG = "hstu/failed/", "hstu/beat/", "hstu/config/"


def distributed_client():
    from jax._src import distributed  # the client is not public API; guarded by its use below

    return distributed.global_state.client


class PeerMonitor:
    """Heartbeat counter and failure reports of this process, in the distributed store."""

    def __init__(self, process_id: int, num_processes: int, poll_s: float = 0.5, client=None):
        self.pid, self.num, self.poll_s = process_id, num_processes, poll_s
        self.client = client if client is not None else distributed_client()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> PeerMonitor:
        self._beat()
        self._thread = threading.Thread(target=self._run, name="hstu-peers", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _beat(self) -> None:
        self.client.key_value_increment(f"{BEAT}{self.pid}", 1)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self._beat()
                reports = self.reports()
            except Exception as exc:  # noqa: BLE001 - the store itself is gone
                if self._stop.is_set():
                    return
                abort(
                    f"process {self.pid} lost the JAX coordinator (process 0): it was killed "
                    f"or failed ({str(exc).splitlines()[0]})"
                )
            if reports and not self._stop.is_set():
                other, message = reports[0]
                abort(f"process {other} failed, so process {self.pid} stops too: {message}")

    def reports(self) -> list[tuple[int, str]]:
        """`(process, message)` of every other process that failed."""
        found = []
        for key, value in self.client.key_value_dir_get(FAILED):
            other = int(key.rsplit("/", 1)[1])
            if other != self.pid:
                found.append((other, value))
        return sorted(found)

    def report(self, message: str) -> None:
        with contextlib.suppress(Exception):  # else the others learn it from the heartbeat
            self.client.key_value_set(f"{FAILED}{self.pid}", message)

    def linger(self, limit_s: float = 5.0) -> None:
        """Process 0 hosts the store: before it ends, give the others time to read its report
        (else they die of the lost coordinator, with JAX's message instead of the real one).
        Returns once every other heartbeat stopped (they ended), or after `limit_s`. Also
        when every other process reported a failure of its own: it may still be on its way
        out, and the store's end would kill it before it exits with its own message."""
        if self.pid != 0 or self.num == 1:
            return
        deadline, last, still = time.time() + limit_s, None, 0.0
        while time.time() < deadline and still < 2 * self.poll_s:
            try:
                now = {p: c for p, c in self.beats().items() if p != self.pid}
            except Exception:  # noqa: BLE001
                return
            still = still + self.poll_s / 2 if now == last else 0.0
            last = now
            time.sleep(self.poll_s / 2)

    def beats(self) -> dict[int, int]:
        out = {}
        for key, value in self.client.key_value_dir_get(BEAT):
            out[int(key.rsplit("/", 1)[1])] = int(value)
        return out

    def silent_peers(self, window_s: float) -> list[int]:
        """Other processes whose heartbeat counter did not move for `window_s` seconds."""
        before = self.beats()
        time.sleep(window_s)
        after = self.beats()
        return [p for p in range(self.num) if p != self.pid and after.get(p) == before.get(p)]

    def check_same_config(self, cfg, timeout_s: float) -> None:
        """Once, at start-up: every process compares its config with every other's."""
        mine = cfg.to_dict()
        self.client.key_value_set(f"{CONFIG}{self.pid}", json.dumps(mine))
        for other in range(self.num):
            if other == self.pid:
                continue
            text = self.client.blocking_key_value_get(f"{CONFIG}{other}", int(timeout_s * 1000))
            diff = config_differences(mine, json.loads(text))
            if diff:
                raise config_mismatch_error(f"process {self.pid}", f"process {other}", diff)

    def fail(self, exc: BaseException, heartbeat_s: float):
        """This process's run failed with `exc`: tell the others (or name who failed first)
        and end the process. Never returns."""
        if not isinstance(exc, HSTUError):  # an input error is this process's own
            reports = self._reports_or_empty()
            if not reports:
                # A collective failed here: did a peer die (killed) or report meanwhile?
                window = min(3.0, heartbeat_s)
                silent = self._silent_or_empty(window)
                reports = self._reports_or_empty()
                if not reports and silent:
                    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                    abort(
                        f"process(es) {silent} stopped: no heartbeat for {window:g} s (killed "
                        f"or crashed); process {self.pid} then failed in a collective "
                        f"({type(exc).__name__}: {first})"
                    )
            if reports:
                other, message = reports[0]
                abort(f"process {other} failed, so process {self.pid} stops too: {message}")
        if isinstance(exc, HSTUError):
            message = str(exc)
        else:
            traceback.print_exception(exc, file=sys.stderr)
            message = f"{type(exc).__name__}: {exc}"
        self.report(f"(process {self.pid}) {message}")
        abort(message, 2 if isinstance(exc, HSTUError) else 1)

    def _reports_or_empty(self) -> list[tuple[int, str]]:
        try:
            return self.reports()
        except Exception:  # noqa: BLE001
            return []

    def _silent_or_empty(self, window_s: float) -> list[int]:
        try:
            return self.silent_peers(window_s)
        except Exception:  # noqa: BLE001
            return []
