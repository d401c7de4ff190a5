"""An embed service process whose pid the test keeps (peak memory), its /metrics scraped, and a
memory watchdog that kills it past a ceiling instead of letting it take the machine down."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

from encdec.launcher import stop_processes, wait_healthy
from encdec.redis_server import free_port


@contextlib.contextmanager
def embed_process(model: str, extra_args: list[str] | None = None, timeout_s: float = 120.0):
    """Starts ``encdec serve-encoder --model MODEL`` on a free loopback port; yields ``(address, proc)``."""
    port = free_port()
    cmd = [sys.executable, "-m", "encdec.cli", "--log-level", "WARNING", "serve-encoder", "--port", str(port)]
    proc = subprocess.Popen([*cmd, "--model", model, *(extra_args or [])], start_new_session=True)
    try:
        wait_healthy(f"127.0.0.1:{port}", timeout_s, proc)
        yield f"127.0.0.1:{port}", proc
    finally:
        stop_processes([proc])


def proc_status_kb(pid: int, key: str) -> int:
    """A ``kB`` field of ``/proc/PID/status`` (``VmRSS``, ``VmHWM``)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def reset_peak_rss(pid: int) -> bool:
    """Resets ``VmHWM`` to the current RSS (``/proc/PID/clear_refs`` 5); False where not allowed."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class MemoryWatchdog:
    """Polls a process's RSS every ``interval_s`` and SIGKILLs it once over ``limit_kb``.

    Attributes:
        killed_at_kb: the RSS it was killed at, or None.
    """

    def __init__(self, pid: int, limit_kb: int, interval_s: float = 0.02) -> None:
        self.pid, self.limit_kb, self.interval_s = pid, limit_kb, interval_s
        self.killed_at_kb: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                rss = proc_status_kb(self.pid, "VmRSS")
            except (OSError, KeyError):
                return
            if rss > self.limit_kb:
                self.killed_at_kb = rss
                os.kill(self.pid, signal.SIGKILL)
                return

    def __enter__(self) -> MemoryWatchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def wait_for(predicate, timeout_s: float, interval_s: float = 0.02) -> bool:
    """Polls ``predicate()`` until true or ``timeout_s`` passes; its last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
