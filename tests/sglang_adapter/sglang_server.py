"""Start and stop a real `python -m sglang.launch_server` on 127.0.0.1 for the tests.

`Server.start(...)` launches it with the CPU flags the issue names through `ServerProcess`
(its own process group on a free port, a bounded wait for /health, `stop()` by the launcher's
pid: the launcher, its scheduler and its detokenizer). The log goes to a file the tests
print on failure.
"""

from __future__ import annotations

import os
import sys

from server_process import ServerProcess

HERE = os.path.dirname(os.path.abspath(__file__))
SITE = os.path.join(HERE, "server_site")  # test-only sitecustomize (baseline patch, dumps)
START_TIMEOUT_S = 300
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


class Server(ServerProcess):
    """`python -m sglang.launch_server` with `launch_command`'s flags (`ServerProcess`)."""

    @classmethod
    def start(
        cls, model: str, backend: str, log_path: str, env: dict[str, str], extra: tuple[str, ...] = ()
    ) -> "Server":
        env = dict(env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (SITE, env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))) if p)
        return cls.launch(lambda port: launch_command(model, backend, port, extra), log_path, env, START_TIMEOUT_S)
