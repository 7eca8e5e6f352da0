"""ctypes binding of kvpilot's compiled decision core (``kvp_core.h``, built by ``make setup``
into ``build/libkvpcore.so``): block naming, the block index, the prefix match and Dynamo's
cost, with the same outcomes as :mod:`kvpilot.routing.index.block_index` and
:mod:`kvpilot.routing.decide.cost` within the scope ``kvp_core.h`` states.

:func:`load` raises :class:`NativeUnavailable` when the library was not built.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path

import numpy as np

LIBRARY = Path(__file__).with_name("build") / "libkvpcore.so"
TIER_CLASSES = {"gpu": 0, "host": 1, "disk": 2, "shared": 3}
""":class:`kvpilot.routing.config.TierClass` values -> ``enum kvp_tier_class``."""
DECISION_HISTOGRAM = "kvpilot_picker_decision_us"
"""The module's histogram of each decision's time, microseconds from its body gathered to its
destination set (``kvp_module.c``'s ``DECISION_HISTOGRAM``)."""
ENVOY_STATS_PREFIX = "envoy_dynamicmodulescustom_"
"""What Envoy's ``/stats/prometheus`` puts before a dynamic module's own stat names."""
OUTCOMES = ("applied", "block_size", "unknown_parent", "bad_shape", "unknown_slot", "no_memory")
"""``enum kvp_outcome``, by value."""

_u32p = np.ctypeslib.ndpointer(np.uint32, flags="C_CONTIGUOUS")
_u64p = np.ctypeslib.ndpointer(np.uint64, flags="C_CONTIGUOUS")
_f64p = np.ctypeslib.ndpointer(np.float64, flags="C_CONTIGUOUS")
_u8p = np.ctypeslib.ndpointer(np.uint8, flags="C_CONTIGUOUS")


class NativeUnavailable(RuntimeError):
    """The compiled core is not built here (run ``make setup``)."""


class CostConfig(ctypes.Structure):
    """``kvp_cost_config``: the fields of the ``cost`` section the formula reads."""

    _fields_ = [
        (name, ctypes.c_double)
        for name in (
            "overlap_score_credit",
            "overlap_score_credit_decay",
            "host_cache_hit_weight",
            "disk_cache_hit_weight",
            "shared_cache_multiplier",
            "prefill_load_scale",
            "decode_active_request_weight",
            "session_affinity_credit",
            "session_residency_weight",
        )
    ] + [("session_stays_unless_sooner", ctypes.c_int)]


class Load(ctypes.Structure):
    """``kvp_load``: one candidate's row of the cost table besides its overlap."""

    _fields_ = [
        (name, ctypes.c_double)
        for name in (
            "prefill_blocks",
            "decode_blocks",
            "requests",
            "shared_decode_blocks",
            "pair_penalty_blocks",
            "resident_blocks",
        )
    ] + [("session_affinity", ctypes.c_int)]


class _Event(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int),
        ("ehashes", ctypes.POINTER(ctypes.c_uint64)),
        ("n_hashes", ctypes.c_size_t),
        ("has_parent", ctypes.c_int),
        ("parent", ctypes.c_uint64),
        ("tokens", ctypes.POINTER(ctypes.c_uint32)),
        ("n_tokens", ctypes.c_size_t),
        ("block_size", ctypes.c_uint32),
        ("medium", ctypes.POINTER(ctypes.c_char)),
        ("medium_len", ctypes.c_size_t),
    ]


class _Scratch(ctypes.Structure):
    _fields_ = [
        ("hashes", ctypes.POINTER(ctypes.c_uint64)),
        ("max_hashes", ctypes.c_size_t),
        ("tokens", ctypes.POINTER(ctypes.c_uint32)),
        ("max_tokens", ctypes.c_size_t),
    ]


class BatchCounts(ctypes.Structure):
    """``kvp_batch_counts``: what one batch carried."""

    _fields_ = [(name, ctypes.c_uint64) for name in ("events", "rejected", "skipped_namespace", "skipped_group")]


_SINK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(_Event))
BODY_STATUSES = (
    *("ok", "malformed", "no_prompt", "not_token_ids", "too_many_ids", "namespaced", "session_field"),
    "refused_field",
)
"""``enum kvp_body_status``, by value."""
EVENT_KINDS = ("stored", "removed", "cleared")

_lib: ctypes.CDLL | None = None


def load() -> ctypes.CDLL:
    """The library, its signatures declared (loaded once). Raises NativeUnavailable."""
    global _lib
    if _lib is None:
        if not LIBRARY.exists():
            raise NativeUnavailable(f"{LIBRARY} is not built: run `make setup`")
        lib = ctypes.CDLL(str(LIBRARY))
        size, u32, u64, ptr = ctypes.c_size_t, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p
        lib.kvp_index_new.restype = ptr
        lib.kvp_index_new.argtypes = [u32, u32, u32, _u64p, u64]
        lib.kvp_index_free.argtypes = [ptr]
        lib.kvp_chain_keys.argtypes = [ptr, _u32p, size, u64, u64, _u64p]
        lib.kvp_index_store.argtypes = [ptr, u32, u32, _u64p, size, ctypes.c_int, u64, u32, _u32p, size]
        lib.kvp_index_remove.argtypes = [ptr, u32, u32, _u64p, size]
        lib.kvp_index_clear_worker.argtypes = [ptr, u32]
        lib.kvp_index_match.restype = size
        lib.kvp_index_match.argtypes = [ptr, _u32p, size, _u32p]
        lib.kvp_tier_overlap.argtypes = [_u32p, _u8p, u32, u32, _f64p]
        lib.kvp_price.restype = size
        lib.kvp_price.argtypes = [ctypes.POINTER(CostConfig), u64, size, _f64p, ctypes.POINTER(Load), _f64p, _u32p]
        text = ctypes.c_char_p
        lib.kvp_parse_prompt.argtypes = [text, size, text, text, _u32p, size, ctypes.POINTER(size)]
        lib.kvp_decode_batch.argtypes = [ctypes.c_char_p, size, ctypes.POINTER(_Scratch), _SINK, ptr]
        lib.kvp_decode_batch.argtypes.append(ctypes.POINTER(BatchCounts))
        dbl = ctypes.c_double
        lib.kvp_ledger_new.restype = ptr
        lib.kvp_ledger_new.argtypes = [u32]
        lib.kvp_ledger_free.argtypes = [ptr]
        lib.kvp_ledger_add.argtypes = [ptr, u32, _u64p, size]
        lib.kvp_ledger_remove.argtypes = [ptr, u32, _u64p, size]
        lib.kvp_ledger_unique.restype = u64
        lib.kvp_ledger_unique.argtypes = [ptr, u32]
        lib.kvp_ledger_shared_depth.restype = size
        lib.kvp_ledger_shared_depth.argtypes = [ptr, u32, _u64p, size]
        lib.kvp_sessions_new.restype = ptr
        lib.kvp_sessions_new.argtypes = [u32, u32, dbl]
        lib.kvp_sessions_free.argtypes = [ptr]
        lib.kvp_sessions_last.restype = ctypes.c_int
        lib.kvp_sessions_last.argtypes = [ptr, u64]
        lib.kvp_sessions_resident.restype = ctypes.POINTER(dbl)
        lib.kvp_sessions_resident.argtypes = [ptr, dbl]
        lib.kvp_sessions_settle.argtypes = [ptr, u64, u32, u32, dbl]
        lib.kvp_sessions_served.argtypes = [ptr, u64, u32, u32, dbl]
        lib.kvp_sessions_count.restype = u32
        lib.kvp_sessions_count.argtypes = [ptr]
        out_ptr, out_len = ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(size)
        lib.kvp_scrub_answer.argtypes = [ctypes.c_char_p, size, out_ptr, out_len]
        lib.kvp_stream_new.restype = ptr
        lib.kvp_stream_free.argtypes = [ptr]
        lib.kvp_stream_feed.argtypes = [ptr, ctypes.c_char_p, size, out_ptr, out_len]
        lib.kvp_free.argtypes = [ctypes.c_void_p]
        _lib = lib
    return _lib


class NativeIndex:
    """A compiled block index of ``max_workers`` workers times ``media`` (worker and medium
    are given by position); names blocks with ``lanes`` and ``position_lane`` (the process's
    own: :mod:`kvpilot.routing.index.chain`). Not thread-safe."""

    def __init__(
        self, block_size: int, max_workers: int, media: Sequence[str], lanes: np.ndarray, position_lane: int
    ) -> None:
        self._lib = load()
        self.block_size, self.max_workers, self.media = block_size, max_workers, tuple(media)
        lanes = np.ascontiguousarray(lanes, dtype=np.uint64)
        self._ptr = self._lib.kvp_index_new(block_size, max_workers, len(self.media), lanes, position_lane)
        if not self._ptr:
            raise ValueError(f"no index of {max_workers} workers x {len(self.media)} media, block size {block_size}")
        self._depths = np.zeros(max_workers * len(self.media), dtype=np.uint32)

    def __del__(self) -> None:
        if getattr(self, "_ptr", None):
            self._lib.kvp_index_free(self._ptr)

    def store(
        self, worker: int, medium: int, ehashes: np.ndarray, parent: int | None, block_size: int, tokens: np.ndarray
    ) -> str:
        """A ``BlockStored``; returns ``"applied"`` or the skip's name."""
        hashes = np.ascontiguousarray(ehashes, dtype=np.uint64)
        toks = np.ascontiguousarray(tokens, dtype=np.uint32)
        code = self._lib.kvp_index_store(
            self._ptr, worker, medium, hashes, len(hashes), parent is not None, parent or 0, block_size, toks, len(toks)
        )
        return OUTCOMES[code]

    def remove(self, worker: int, medium: int, ehashes: np.ndarray) -> str:
        """A ``BlockRemoved``; returns ``"applied"`` or the skip's name."""
        hashes = np.ascontiguousarray(ehashes, dtype=np.uint64)
        return OUTCOMES[self._lib.kvp_index_remove(self._ptr, worker, medium, hashes, len(hashes))]

    def clear_worker(self, worker: int) -> None:
        self._lib.kvp_index_clear_worker(self._ptr, worker)

    def match(self, tokens: np.ndarray) -> np.ndarray:
        """Depths, shape ``(max_workers, len(media))`` (a view valid until the next match)."""
        toks = np.ascontiguousarray(tokens, dtype=np.uint32)
        self._lib.kvp_index_match(self._ptr, toks, len(toks), self._depths)
        return self._depths.reshape(self.max_workers, len(self.media))

    def chain_keys(self, tokens: np.ndarray) -> np.ndarray:
        """The keys of ``tokens``' full blocks from block 0."""
        toks = np.ascontiguousarray(tokens, dtype=np.uint32)
        out = np.zeros(len(toks) // self.block_size, dtype=np.uint64)
        self._lib.kvp_chain_keys(self._ptr, toks, len(out), 0, 0, out)
        return out


class NativeLedger:
    """The compiled active-block ledger (``kvp_ledger.c``) of ``n_workers`` workers, by position."""

    def __init__(self, n_workers: int) -> None:
        self._lib, self.n_workers = load(), n_workers
        self._ptr = self._lib.kvp_ledger_new(n_workers)
        if not self._ptr:
            raise ValueError(f"no ledger of {n_workers} workers")

    def __del__(self) -> None:
        if getattr(self, "_ptr", None):
            self._lib.kvp_ledger_free(self._ptr)

    def add(self, worker: int, keys: Sequence[int]) -> str:
        """A request naming ``keys`` became active on ``worker``; ``"applied"`` or the refusal's name."""
        arr = np.ascontiguousarray(keys, dtype=np.uint64)
        return OUTCOMES[self._lib.kvp_ledger_add(self._ptr, worker, arr, len(arr))]

    def remove(self, worker: int, keys: Sequence[int]) -> None:
        arr = np.ascontiguousarray(keys, dtype=np.uint64)
        self._lib.kvp_ledger_remove(self._ptr, worker, arr, len(arr))

    def unique(self, worker: int) -> int:
        return int(self._lib.kvp_ledger_unique(self._ptr, worker))

    def shared_depth(self, worker: int, keys: Sequence[int]) -> int:
        arr = np.ascontiguousarray(keys, dtype=np.uint64)
        return int(self._lib.kvp_ledger_shared_depth(self._ptr, worker, arr, len(arr)))


class NativeSessions:
    """The compiled session table (``kvp_session.c``): ``capacity`` sessions of ``n_workers``
    workers, each living on its worker ``horizon_s`` after it settled."""

    def __init__(self, capacity: int, n_workers: int, horizon_s: float) -> None:
        self._lib, self.n_workers = load(), n_workers
        self._ptr = self._lib.kvp_sessions_new(capacity, n_workers, horizon_s)
        if not self._ptr:
            raise ValueError(f"no session table of {capacity} sessions, {n_workers} workers, horizon {horizon_s}")

    def __del__(self) -> None:
        if getattr(self, "_ptr", None):
            self._lib.kvp_sessions_free(self._ptr)

    def last(self, key: int) -> int | None:
        worker = int(self._lib.kvp_sessions_last(self._ptr, key))
        return None if worker < 0 else worker

    def resident(self, now: float) -> list[float]:
        row = self._lib.kvp_sessions_resident(self._ptr, now)
        return [row[w] for w in range(self.n_workers)]

    def settle(self, key: int, worker: int, blocks: int, now: float) -> None:
        self._lib.kvp_sessions_settle(self._ptr, key, worker, blocks, now)

    def served(self, key: int, worker: int, blocks: int, now: float) -> None:
        self._lib.kvp_sessions_served(self._ptr, key, worker, blocks, now)

    def __len__(self) -> int:
        return int(self._lib.kvp_sessions_count(self._ptr))


def tier_overlaps(depths: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """Each worker's :class:`~kvpilot.routing.decide.cost.TierOverlap`, shape ``(workers, 4)``,
    from :meth:`NativeIndex.match`'s depths and each medium's tier class."""
    lib, classes = load(), np.ascontiguousarray(classes, dtype=np.uint8)
    shared_media = classes == TIER_CLASSES["shared"]
    shared = int(depths[:, shared_media].max()) if shared_media.any() and depths.size else 0
    out = np.zeros((len(depths), 4))
    row = np.zeros(4)
    for w in range(len(depths)):
        lib.kvp_tier_overlap(np.ascontiguousarray(depths[w]), classes, len(classes), shared, row)
        out[w] = row
    return out


def price(
    config: CostConfig, prompt_blocks: int, overlap: np.ndarray, loads: Sequence[Load]
) -> tuple[np.ndarray, list[int]]:
    """Each candidate's cost, and the rows tied at the lowest cost among the eligible ones."""
    n = len(loads)
    costs, ties = np.zeros(n), np.zeros(max(n, 1), dtype=np.uint32)
    rows = (Load * max(n, 1))(*loads)
    count = load().kvp_price(
        ctypes.byref(config), prompt_blocks, n, np.ascontiguousarray(overlap, dtype=np.float64), rows, costs, ties
    )
    return costs, ties[:count].tolist()


def parse_prompt(
    body: bytes, max_ids: int, served_model: str | None = None, accepted: Sequence[str] | None = None
) -> tuple[str, list[int]]:
    """``kvp_parse_prompt``: the body's status (:data:`BODY_STATUSES`) and its prompt's ids
    (a body naming another model than ``served_model``, where given, is namespaced; one with a
    top-level field outside ``accepted``, where given, refused)."""
    ids, n = np.zeros(max(max_ids, 1), dtype=np.uint32), ctypes.c_size_t(0)
    model = None if served_model is None else served_model.encode()
    fields = None if accepted is None else "\n".join(accepted).encode()
    status = load().kvp_parse_prompt(body, len(body), model, fields, ids, max_ids, ctypes.byref(n))
    return BODY_STATUSES[status], ids[: n.value].tolist()


def decode_batch(
    payload: bytes, max_tokens: int = 1 << 16
) -> tuple[bool, list[tuple[str, list[int], int | None, list[int], int, str]], BatchCounts]:
    """``kvp_decode_batch``: whether the batch decoded, each event handed on as
    ``(kind, engine hashes, parent, token ids, block size, medium)``, and the counts."""
    hashes, tokens = (ctypes.c_uint64 * max_tokens)(), (ctypes.c_uint32 * max_tokens)()
    scratch = _Scratch(hashes, max_tokens, tokens, max_tokens)
    events: list[tuple[str, list[int], int | None, list[int], int, str]] = []

    def sink(_: int | None, event: ctypes._Pointer[_Event]) -> None:
        e = event.contents
        events.append(
            (
                EVENT_KINDS[e.kind],
                e.ehashes[: e.n_hashes] if e.n_hashes else [],
                e.parent if e.has_parent else None,
                e.tokens[: e.n_tokens] if e.n_tokens else [],
                e.block_size,
                ctypes.string_at(e.medium, e.medium_len).decode(errors="replace"),
            )
        )

    counts = BatchCounts()
    status = load().kvp_decode_batch(
        payload, len(payload), ctypes.byref(scratch), _SINK(sink), None, ctypes.byref(counts)
    )
    return status == 0, events, counts


SCRUBBED = {-2: "no_memory", -1: "unreadable", 0: "unchanged", 1: "changed"}
"""``enum kvp_scrubbed`` (``kvp_answer.h``), by value."""


def _taken(lib: ctypes.CDLL, code: int, out: ctypes.c_void_p, n: ctypes.c_size_t) -> tuple[str, bytes | None]:
    if code != 1:
        return SCRUBBED[code], None
    text = ctypes.string_at(out.value or 0, n.value) if n.value else b""
    lib.kvp_free(out)
    return SCRUBBED[code], text


def scrub_answer(body: bytes) -> tuple[str, bytes | None]:
    """``kvp_scrub_answer``: the outcome (:data:`SCRUBBED`) and, when ``changed``, the answer
    the client gets."""
    lib, out, n = load(), ctypes.c_void_p(), ctypes.c_size_t(0)
    return _taken(lib, lib.kvp_scrub_answer(body, len(body), ctypes.byref(out), ctypes.byref(n)), out, n)


def withheld_bodies() -> tuple[bytes, bytes]:
    """``kvp_withheld_chunk`` and ``kvp_withheld_answer``, as the module writes them."""
    lib = load()
    chunk, answer = (ctypes.c_char.in_dll(lib, name) for name in ("kvp_withheld_chunk", "kvp_withheld_answer"))
    return ctypes.string_at(ctypes.addressof(chunk)), ctypes.string_at(ctypes.addressof(answer))


class Stream:
    """``kvp_stream``: one streamed answer's chunks, each as the client gets it."""

    def __init__(self) -> None:
        self._lib = load()
        self._ptr = self._lib.kvp_stream_new()

    def __del__(self) -> None:
        if getattr(self, "_ptr", None):
            self._lib.kvp_stream_free(self._ptr)

    def feed(self, chunk: bytes) -> bytes:
        """What the client gets for ``chunk`` (``chunk`` itself when it passes unchanged)."""
        out, n = ctypes.c_void_p(), ctypes.c_size_t(0)
        code = self._lib.kvp_stream_feed(self._ptr, chunk, len(chunk), ctypes.byref(out), ctypes.byref(n))
        outcome, text = _taken(self._lib, code, out, n)
        if outcome == "no_memory":
            raise MemoryError("kvp_stream_feed")
        return chunk if text is None else text
