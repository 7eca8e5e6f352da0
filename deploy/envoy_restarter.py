"""Envoy's hot restarter: the parent Envoy's hot restart expects
(``python -m kvpilot.deploy.envoy_restarter ENVOY_ARGV...``).

Envoy in hot-restart mode asks to be signalled when its parent dies, so its parent must
outlive it: a launcher that exits after starting it would take it down. This process is
that parent, as Envoy's own ``hot-restarter.py`` is:

- it starts epoch 0 (``ENVOY_ARGV`` plus ``--restart-epoch 0``) at once;
- on SIGHUP it starts the next epoch, which takes over the listeners while the previous
  one serves its open streams until its drain ends (Envoy's ``--drain-time-s`` and
  ``--parent-shutdown-time-s``, already in ``ENVOY_ARGV``);
- on SIGTERM or SIGINT it stops every Envoy it started and exits 0;
- when the newest Envoy exits on its own, it stops the others and exits with its code.

It writes nothing but Envoy's own output (inherited) and one line per epoch.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from types import FrameType

POLL_S = 0.2
STOP_GRACE_S = 10.0


class Restarter:
    """The Envoys of one family, newest last."""

    def __init__(self, argv: Sequence[str]) -> None:
        self.argv = list(argv)
        self.children: list[subprocess.Popen[bytes]] = []
        self.stopping = False

    def start_epoch(self) -> None:
        epoch = len(self.children)
        print(f"envoy_restarter: starting epoch {epoch}", flush=True)
        self.children.append(subprocess.Popen([*self.argv, "--restart-epoch", str(epoch)]))

    def on_hangup(self, signum: int, frame: FrameType | None) -> None:
        self.start_epoch()

    def on_stop(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True

    def stop_all(self) -> None:
        for child in self.children:
            if child.poll() is None:
                child.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for child in self.children:
            try:
                child.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()

    def run(self) -> int:
        signal.signal(signal.SIGHUP, self.on_hangup)
        signal.signal(signal.SIGTERM, self.on_stop)
        signal.signal(signal.SIGINT, self.on_stop)
        self.start_epoch()
        while not self.stopping:
            newest = self.children[-1]
            if newest.poll() is not None:
                self.stop_all()
                return int(newest.returncode)
            time.sleep(POLL_S)
        self.stop_all()
        return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print("usage: python -m kvpilot.deploy.envoy_restarter ENVOY [ARG...]", file=sys.stderr)
        return 2
    return Restarter(args).run()


if __name__ == "__main__":
    sys.exit(main())
