"""Free loopback ports for the ZMQ tests."""

from __future__ import annotations

import random
import socket


def free_ports(n: int) -> list[int]:
    """Distinct free ports below the ephemeral range (a connecting PUB cannot self-connect).

    Plain sockets, closed synchronously (a closed ZMQ socket frees its port later).
    """
    rng, socks, ports = random.Random(), [], []
    try:
        while len(ports) < n:
            sock = socket.socket()
            try:
                port = rng.randrange(20000, 30000)
                sock.bind(("127.0.0.1", port))
            except OSError:
                sock.close()
                continue
            socks.append(sock)
            ports.append(port)
        return ports
    finally:
        for sock in socks:
            sock.close()
