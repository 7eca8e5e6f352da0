"""The agent benchmark's five arms, one class each (what each arm is and why:
:mod:`benchmarks.bench_agent`'s module doc).

Contract of an :class:`Arm`: built on a running fleet (:class:`ArmSetup`: its P, D
and kvpilot router, the arm's ``cache_salt``); :meth:`Arm.running` starts what the
arm runs besides the fleet (a router) and stops it on exit; inside it,
:meth:`Arm.before_step` runs before each lockstep step and :meth:`Arm.serve` sends
one session's prompt of that step, from as many threads as there are sessions; it
raises what the HTTP client raises (the runner counts the request failed).
:meth:`Arm.handicaps` lists, after the arm, what it did that the others did not.
"""

from __future__ import annotations

import enum
import json
import threading
import time
import urllib.request
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from benchmarks.agent import workload as aw
from benchmarks.agent.vllm_router_arm import running_vllm_router
from kvpilot.deploy.agent_session import prefill_then_decode
from kvpilot.deploy.client import Completion, complete

ROUTE_HEADER = "X-KVPilot-Route"
"""The kvpilot router's answer header naming the route it took."""
VLLM_ROUTER_PORT = 9420


class FleetName(enum.Enum):
    """The two fleets of the run (see :mod:`benchmarks.bench_agent`)."""

    N = "N"
    """Plain NixlConnector engines: the reference, the calibration and arms a-d."""
    K = "K"
    """KVPilotConnector engines behind the kvpilot router: arm e."""
    B = "B"
    """KVPilotConnector as a drop-in for fleet N's NixlConnector (its keys, vLLM's pull
    rule), so the engines keep their thread binding: arm f."""


@dataclass(frozen=True)
class ArmSetup:
    """What an arm serves on."""

    p_url: str
    d_url: str
    router_url: str
    """The fleet's kvpilot router."""
    salt: str
    """The arm's ``cache_salt``: no arm inherits another's cache."""
    generated: int
    timeout: float
    shared_prefix: list[aw.Message]
    log_dir: Path


@dataclass(frozen=True)
class Served:
    """One request's answer, and what the arm knows of how it was served."""

    completion: Completion
    route: str | None = None
    """The kvpilot router's route (arm e)."""
    p_seconds: float | None = None
    """P's half of the latency (the arms that proxy P->D themselves)."""


class Arm(ABC):
    """One way to serve the agent (the contract: this module's doc)."""

    key: ClassVar[str]
    """The arm's letter on the command line (``--arms``)."""
    title: ClassVar[str]
    fleet: ClassVar[FleetName]

    def __init__(self, setup: ArmSetup) -> None:
        self.setup = setup

    @contextmanager
    def running(self) -> Iterator[None]:
        """Start what the arm runs besides its fleet; stop it on exit. Default: nothing."""
        yield

    def describe(self) -> str:
        """The arm as its start is logged."""
        return self.title

    def before_step(self, step: int) -> None:
        """Runs before step ``step`` (and before its counters are scraped). Default: nothing."""
        return None

    @abstractmethod
    def serve(self, session: int, prompt: list[aw.Message]) -> Served:
        """Send ``session``'s messages of the current step (with the workload's tools); thread-safe."""

    def handicaps(self) -> list[str]:
        """What this arm did that the others did not, for its line of the report."""
        return []

    def _through_proxy(self, prompt: list[aw.Message], salt: str, p_params: dict[str, Any] | None = None) -> Served:
        s = self.setup
        handoff = prefill_then_decode(
            s.p_url, s.d_url, prompt, s.generated, s.timeout, p_params, cache_salt=salt, tools=aw.TOOLS
        )
        return Served(handoff.d, p_seconds=handoff.p.total_seconds)

    def _generate(self, url: str, prompt: list[aw.Message], **extra: Any) -> Completion:
        s = self.setup
        return complete(
            url,
            prompt,
            max_tokens=s.generated,
            ignore_eos=True,
            return_token_ids=True,
            cache_salt=s.salt,
            timeout=s.timeout,
            tools=aw.TOOLS,
            **extra,
        )


class NoPrefixCache(Arm):
    """(a): a fresh salt per request, through the P->D proxy."""

    key = "a"
    title = "(a) no prefix cache"
    fleet = FleetName.N

    def serve(self, session: int, prompt: list[aw.Message]) -> Served:
        return self._through_proxy(prompt, f"a-{uuid.uuid4().hex}")


class PrefixOnly(Arm):
    """(b): P's prefix cache reset and re-warmed with the shared prefix before each
    step, then the P->D proxy without session state."""

    key = "b"
    title = "(b) prefix only (P re-prefills)"
    fleet = FleetName.N

    def __init__(self, setup: ArmSetup) -> None:
        super().__init__(setup)
        self.reset_attempts: list[int] = []

    def before_step(self, step: int) -> None:
        s = self.setup
        self.reset_attempts.append(reset_prefix_cache(s.p_url))
        complete(s.p_url, s.shared_prefix, max_tokens=1, cache_salt=s.salt, timeout=s.timeout, tools=aw.TOOLS)

    def serve(self, session: int, prompt: list[aw.Message]) -> Served:
        return self._through_proxy(prompt, self.setup.salt)

    def handicaps(self) -> list[str]:
        return [f"P's prefix cache reset before every step (attempts: max {max(self.reset_attempts)})"]


class ConversationIdProxy(Arm):
    """(c): the behaviour of vLLM's ``disagg_proxy_multiturn.py``: D's returned params
    kept per conversation (single use, a TTL) and sent to P with the next turn."""

    key = "c"
    title = "(c) vLLM conversation_id proxy"
    fleet = FleetName.N
    TTL_S = 450.0  # the example's: below vLLM's 480 s hold of D's blocks
    MISS: ClassVar[dict[str, Any]] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }

    def __init__(self, setup: ArmSetup) -> None:
        super().__init__(setup)
        self._store: dict[str, tuple[dict[str, Any], float]] = {}
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def _take(self, conversation_id: str) -> dict[str, Any]:
        """The params to send P: the conversation's stored offer (single use) if
        fresh, else :attr:`MISS`; counts which."""
        with self._lock:
            entry = self._store.pop(conversation_id, None)
            if entry is None or time.time() - entry[1] > self.TTL_S:
                self.misses += 1
                return dict(self.MISS)
            self.hits += 1
        return {**entry[0], "do_remote_decode": True, "do_remote_prefill": False}

    def serve(self, session: int, prompt: list[aw.Message]) -> Served:
        conversation_id = f"session-{session}"
        served = self._through_proxy(prompt, self.setup.salt, self._take(conversation_id))
        if served.completion.kv_transfer_params:
            with self._lock:
                self._store[conversation_id] = (dict(served.completion.kv_transfer_params), time.time())
        return served

    def handicaps(self) -> list[str]:
        return [f"proxy offers sent to P: {self.hits}, misses: {self.misses}"]


class VllmRouterPD(Arm):
    """(d): vllm-router in P/D mode in front of the fleet (:mod:`vllm_router_arm`)."""

    key = "d"
    title = "(d) vllm-router PD"
    fleet = FleetName.N

    def __init__(self, setup: ArmSetup) -> None:
        super().__init__(setup)
        self._url: str | None = None

    @contextmanager
    def running(self) -> Iterator[None]:
        s = self.setup
        with running_vllm_router([s.p_url], [s.d_url], VLLM_ROUTER_PORT, s.log_dir / "vllm-router.log") as url:
            self._url = url
            try:
                yield
            finally:
                self._url = None

    def serve(self, session: int, prompt: list[aw.Message]) -> Served:
        if self._url is None:
            raise RuntimeError("vllm-router is not running (serve outside running())")
        return Served(self._generate(self._url, prompt))


class Kvpilot(Arm):
    """(e): the kvpilot router, ``conversation_id`` = the session."""

    key = "e"
    title = "(e) kvpilot"
    fleet = FleetName.K

    def describe(self) -> str:
        return f"{self.title} via {self.setup.router_url}"

    def serve(self, session: int, prompt: list[aw.Message]) -> Served:
        out = self._generate(self.setup.router_url, prompt, conversation_id=f"session-{session}")
        return Served(out, route=out.headers.get(ROUTE_HEADER))


class BoundConversationIdProxy(ConversationIdProxy):
    """(f): arm (c) on fleet B, whose engines differ from fleet N's by the thread
    binding KVPilotConnector restores (``--handicap-arm``): what (c) - (f) shows is
    what vLLM's binding of the model thread costs (c)."""

    key = "f"
    title = "(f) (c) with the thread binding kept"
    fleet = FleetName.B


ARMS: tuple[type[Arm], ...] = (
    NoPrefixCache,
    PrefixOnly,
    ConversationIdProxy,
    VllmRouterPD,
    Kvpilot,
    BoundConversationIdProxy,
)
"""Every arm, in the order they are reported (they run in the shuffled order of
:mod:`agent_schedule`)."""


def reset_prefix_cache(p_url: str, attempts: int = 40) -> int:
    """Empty P's prefix cache (dev mode). vLLM refuses while blocks are held; a tiny
    local request makes P step and free the blocks D finished reading. Returns the
    number of attempts it took; raises after ``attempts``."""
    for attempt in range(1, attempts + 1):
        request = urllib.request.Request(f"{p_url}/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(request, timeout=60.0) as resp:
            if json.load(resp).get("success"):
                return attempt
        complete(p_url, [aw.FIRST_ORDINARY_ID] * 4, max_tokens=1, timeout=60)
        time.sleep(0.25)
    raise RuntimeError(f"{p_url}: /reset_prefix_cache refused {attempts} times (blocks still held)")
