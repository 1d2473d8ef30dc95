"""Start and stop a real `python -m sglang.launch_server` on 127.0.0.1 for the tests.

`Server.start(...)` launches it in its own process group on a free port with the CPU
flags the issue names, waits (bounded) for /health, and `stop()` ends that process group
by the launcher's pid (SIGTERM, then SIGKILL after a bounded wait): the launcher, its
scheduler and its detokenizer. The log goes to a file the tests print on failure.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import requests
from ports import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
SITE = os.path.join(HERE, "server_site")  # test-only sitecustomize (baseline patch, dumps)
START_TIMEOUT_S = 300
STOP_TIMEOUT_S = 30
MAX_TOTAL_TOKENS = 16384
CHUNK = 1024


def launch_command(model: str, backend: str, port: int, extra: tuple[str, ...] = ()) -> list[str]:
    return [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", model,
        "--attention-backend", backend,
        "--device", "cpu",
        "--dtype", "bfloat16",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--disable-radix-cache",
        "--skip-server-warmup",
        "--disable-cuda-graph",
        "--max-total-tokens", str(MAX_TOTAL_TOKENS),
        "--max-running-requests", "4",
        "--chunked-prefill-size", str(CHUNK),
        "--log-level", "info",
        *extra,
    ]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log_path: str
    start_s: float = 0.0
    stopped: bool = field(default=False)

    @classmethod
    def start(
        cls, model: str, backend: str, log_path: str, env: dict[str, str], extra: tuple[str, ...] = ()
    ) -> "Server":
        port = free_port()
        full_env = {**os.environ, **env}
        full_env["PYTHONPATH"] = os.pathsep.join(p for p in (SITE, full_env.get("PYTHONPATH", "")) if p)
        t0 = time.monotonic()
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                launch_command(model, backend, port, extra), stdout=log, stderr=subprocess.STDOUT,
                env=full_env, start_new_session=True,
            )
        server = cls(proc, f"http://127.0.0.1:{port}", log_path)
        try:
            server._wait_healthy(t0 + START_TIMEOUT_S)
        except BaseException:
            server.stop()
            raise
        server.start_s = time.monotonic() - t0
        return server

    def _wait_healthy(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"server not healthy within {START_TIMEOUT_S} s:\n{self.log_tail()}")

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
        for sig, wait in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, STOP_TIMEOUT_S)):
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
                # Children may outlive the launcher briefly: make sure the group is gone.
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
            break
