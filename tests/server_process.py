"""A real engine server on 127.0.0.1 for tests and GPU scripts: started in its own process
group on a free port, waited for (bounded) until /health answers, stopped by its pid.

`ServerProcess.launch(command, log_path)` takes the command as a function of the port;
`stop()` ends the process group by the launcher's pid (SIGTERM, then SIGKILL after a bounded
wait), so an engine's scheduler and worker processes go with it. The log goes to a file that
failures quote.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

import requests
from ports import free_port

STOP_TIMEOUT_S = 30


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str
    log_path: str
    start_s: float = 0.0
    stopped: bool = False

    @classmethod
    def launch(cls, command: Callable[[int], list[str]], log_path: str, env: dict[str, str] | None = None,
               timeout_s: float = 300):
        """Start `command(port)` with os.environ + env and wait until /health answers 200
        (RuntimeError if it exits first, TimeoutError after timeout_s; stopped either way)."""
        port = free_port()
        t0 = time.monotonic()
        with open(log_path, "w") as log:
            proc = subprocess.Popen(command(port), stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, **(env or {})}, start_new_session=True)
        server = cls(proc, f"http://127.0.0.1:{port}", str(log_path))
        try:
            server._wait_healthy(t0 + timeout_s, timeout_s)
        except BaseException:
            server.stop()
            raise
        server.start_s = time.monotonic() - t0
        return server

    def _wait_healthy(self, deadline: float, timeout_s: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"server not healthy within {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        with open(self.log_path, errors="replace") as f:
            lines = [ln for ln in f.read().splitlines() if "server_args=" not in ln]
        return "\n".join(lines[-n:])

    def log_text(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        """End the server's process group (by the launcher's pid); bounded waits."""
        if self.stopped:
            return
        self.stopped = True
        pid = self.proc.pid
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
                # Children may outlive the launcher briefly: make sure the group is gone.
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
            break
