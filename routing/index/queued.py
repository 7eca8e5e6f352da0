"""An index whose changes other threads queue without waking its owner (:class:`QueuedIndex`).

The feeder's thread reads and decodes the engines' KV events; handing each change to the
event loop with ``call_soon_threadsafe`` wakes the loop once a batch, which costs more than
applying the batch. Here the feeder only appends the change to a queue, and the loop runs
the queued changes when it next reads the index (a decision's match, a metrics scrape) or when
:meth:`QueuedIndex.run_queued` is called: by the feeder's prompt once a pass while the index
is being matched (so a decision seldom applies them itself), and every
:data:`RUN_QUEUED_INTERVAL_S` (so the queue stays short where nothing reads). A read sees
every change queued before it, in the order queued, as it did when each change woke the loop.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence

from kvpilot.routing.ids import DEFAULT_TIER, Tier, WorkerId
from kvpilot.routing.index.chain import PromptChain
from kvpilot.routing.index.events import KVEvent
from kvpilot.routing.index.kvindex import KVIndex, Match, Prepared

RUN_QUEUED_INTERVAL_S = 0.1
"""How often the router runs the queued changes where no read did (the longest a change
waits to reach the index's metrics on an idle router)."""


class QueuedIndex:
    """A :class:`~kvpilot.routing.index.kvindex.KVIndex` over ``inner``, whose owner runs the
    changes queued by :meth:`defer` before each of its own calls.

    :meth:`defer` is the one method any thread may call (``deque.append`` is atomic); every
    other call is the owner's, as for ``inner``. A deferred change must act on ``inner``
    itself, never on this index (it runs while the queue is being emptied)."""

    def __init__(self, inner: KVIndex) -> None:
        self.inner = inner
        self.block_size = inner.block_size
        self.counters: Counter[str] = inner.counters
        self._queued: deque[Callable[[], object]] = deque()
        self.matches = 0
        """How many :meth:`match` calls were made (any thread may read it, to tell whether
        the index is being read)."""

    def defer(self, change: Callable[[], object]) -> None:
        """Queue ``change`` (a call on :attr:`inner`) for the owner's next call; any thread."""
        self._queued.append(change)

    def run_queued(self) -> int:
        """Run the queued changes, in the order queued; returns how many ran."""
        ran = 0
        while self._queued:
            self._queued.popleft()()
            ran += 1
        return ran

    def apply(self, worker: WorkerId, event: KVEvent) -> str:
        self.run_queued()
        return self.inner.apply(worker, event)

    def apply_all(self, worker: WorkerId, events: Iterable[KVEvent]) -> None:
        self.run_queued()
        self.inner.apply_all(worker, events)

    def prepare(self, events: Sequence[KVEvent]) -> Prepared:
        return self.inner.prepare(events)

    def apply_prepared(self, worker: WorkerId, prepared: Prepared) -> None:
        self.run_queued()
        self.inner.apply_prepared(worker, prepared)

    def clear_worker(self, worker: WorkerId) -> None:
        self.run_queued()
        self.inner.clear_worker(worker)

    def remove_worker(self, worker: WorkerId) -> None:
        self.run_queued()
        self.inner.remove_worker(worker)

    def workers(self) -> list[WorkerId]:
        self.run_queued()
        return self.inner.workers()

    def block_count(self, worker: WorkerId, tier: Tier = DEFAULT_TIER) -> int:
        self.run_queued()
        return self.inner.block_count(worker, tier)

    def match(self, chain: PromptChain) -> Match:
        self.matches += 1
        self.run_queued()
        return self.inner.match(chain)
