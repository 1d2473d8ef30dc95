"""A free TCP port for a test server, outside the kernel's ephemeral port range."""

from __future__ import annotations

import random
import socket


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A port on 127.0.0.1 that is free now and that no client socket takes as its source.

    A port from bind(0) lies in the ephemeral range, and a health check polling it before the
    server listens can connect to itself from that very port (TCP simultaneous open): the
    server's bind then fails with EADDRINUSE (seen in CI). Ports outside the range are never
    handed out as source ports.
    """
    low, high = _ephemeral_range()
    candidates = range(20000, low) if low > 21000 else range(high + 1, 65536)
    for port in random.Random().sample(candidates, min(200, len(candidates))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free TCP port outside the ephemeral range on 127.0.0.1")
