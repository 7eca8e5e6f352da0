"""The fleet from a file an operator (or an autoscaler) edits: :class:`WorkersFile` reads
``server.workers_file`` (a YAML list of ``workers`` entries) and, while the router runs, reads it
again whenever it changes, handing each new fleet to the router
(:meth:`~kvpilot.routing.core.RouterCore.set_fleet`: joined workers are routed to and their KV
events subscribed, departed ones dropped from the index, the ledger and the health records
as their requests end). On Kubernetes the file is a ConfigMap's key, which the kubelet
refreshes in the pod when the ConfigMap changes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import msgspec
import yaml

from kvpilot.routing.config import ConfigError, Worker
from kvpilot.routing.fleet import Fleet, checked_fleet

log = logging.getLogger(__name__)


class WorkersFile:
    """``path``'s fleet, checked every ``poll_s`` for a change (its modification time and size)."""

    def __init__(self, path: Path, poll_s: float) -> None:
        self.path = path
        self.poll_s = poll_s
        self._seen: tuple[int, int] | None = None

    def read(self) -> Fleet:
        """The fleet the file lists now; raises :class:`ConfigError` naming the file and the
        entry (``server.workers_file[i]``) when it cannot be read or lists no fleet."""
        try:
            stat = self.path.stat()
            self._seen = (stat.st_mtime_ns, stat.st_size)  # a bad edit is reported once, not every poll
            entries = yaml.safe_load(self.path.read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError("server.workers_file", f"cannot read {str(self.path)!r}: {exc}") from None
        if not isinstance(entries, list):
            raise ConfigError("server.workers_file", f"{str(self.path)!r} must hold a list of workers")
        workers = []
        for i, entry in enumerate(entries):
            try:
                workers.append(msgspec.convert(entry, Worker))
            except (msgspec.ValidationError, ConfigError) as exc:
                raise ConfigError(f"server.workers_file[{i}]", str(exc)) from None
        return checked_fleet(workers, "server.workers_file")

    def changed(self) -> bool:
        """Whether the file differs from what :meth:`read` last read (a file gone: no)."""
        try:
            stat = self.path.stat()
        except OSError:
            return False
        return (stat.st_mtime_ns, stat.st_size) != self._seen

    async def watch(self, serve: Callable[[Fleet], None]) -> None:
        """Hand ``serve`` each new fleet the file lists, until cancelled; a file that cannot
        be read or lists no fleet is logged and the fleet served stays as it was."""
        while True:
            await asyncio.sleep(self.poll_s)
            if not self.changed():
                continue
            try:
                fleet = self.read()
            except ConfigError as exc:
                log.error("%s; the fleet stays as it was", exc)
                continue
            serve(fleet)
