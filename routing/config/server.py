"""The ``server`` section: the HTTP front's address, model, limits, admission, timeouts,
circuits, keys and calibration."""

from __future__ import annotations

import msgspec

from kvpilot.policies.typed_config import TypedConfig, check_range
from kvpilot.routing.config.errors import ConfigError


class ServerConfig(TypedConfig, frozen=True):
    """The HTTP front: where it listens, the model it serves, upstream timeouts."""

    error_type = ConfigError

    host: str = "127.0.0.1"
    """The address the HTTP front (and the picker) binds; anything but loopback is
    reachable from other machines and warned about at start."""
    port: int = 8000
    """The HTTP front's port."""
    model_name: str = "tiny"
    """The model name clients send (``"model"``) and ``/v1/models`` lists; a request naming
    another is refused (404)."""
    model_dir: str = ""
    """The served model's directory: its ``tokenizer.json`` and ``tokenizer_config.json``
    (the router tokenizes once), and its ``config.json`` (the roofline prior). Required by
    ``kvpilot router``."""
    prefill_timeout_s: float = 30.0
    """The floor of P's timeout for a remote prefill: P is given ``max(this, 3 x its
    predicted queue and prefill)``; past it the request is prefilled on D instead."""
    request_timeout_s: float = 600.0
    """The longest a request may take end to end (D's whole answer); past it the router ends
    it (and a request Envoy carries is released from the picker's books)."""
    engine_metrics_interval_s: float = 5.0
    """How often each engine's ``/metrics`` is read (running, waiting, KV usage; the measured
    rates); 0: never (beside Dynamo it is never read: its workers publish no vLLM metrics)."""
    max_body_bytes: int = 4 << 20
    """Larger bodies are refused (413): 4 MiB holds 8K token ids or a long chat."""
    max_prompt_tokens: int = 0
    """Prompts longer than this are refused (400) before routing; 0: no limit. The
    fleet sets the engines' max model length."""
    max_output_tokens: int = 0
    """``max_tokens`` (``max_completion_tokens``) above this is refused (400); 0: no limit."""
    max_model_len: int = 0
    """The engines' ``--max-model-len``: with it the router refuses, before any engine sees
    them, the prompts and output lengths vLLM would refuse, with vLLM's messages
    (:mod:`kvpilot.routing.serve.engine_checks`), and truncates as vLLM does. 0: learned at
    start from the engines' ``/v1/models``; set, it must equal what they state there
    (:mod:`kvpilot.routing.serve.learned_limits`)."""
    allow_unchecked_lengths: bool = False
    """Serve even when ``max_model_len`` is known neither from the engines nor from the config,
    leaving prompt and output lengths to the engines (a refusal then reaches the client from
    D, after P prefilled). Off: the router refuses to start without a length."""
    max_logprobs: int = 20
    """The engines' ``--max-logprobs`` (vLLM's default 20; -1: the vocabulary): more
    ``logprobs``, ``top_logprobs`` or ``prompt_logprobs`` are refused with vLLM's message.
    vLLM states it on no endpoint, so it is not learned: ``kvpilot fleet up`` sets it from
    ``--engine-args``; a router started otherwise must be given the engines' value."""
    max_concurrent_requests: int = 0
    """Requests in flight at once; 0: no limit (no queue)."""
    max_queued_requests: int = 256
    """Requests waiting for a slot; more are refused at once (429)."""
    queue_timeout_s: float = 30.0
    """A queued request not admitted within this is refused (503)."""
    ttft_slo_s: float = 0.0
    """A routed request whose predicted TTFT (:mod:`kvpilot.routing.decide.rates`: queue,
    prefill, transfer, first decode step) is over this is refused before any engine
    sees it: 429 when the queue ahead of it is what puts it over, else 503, both with
    ``Retry-After`` (:func:`kvpilot.routing.serve.admission.check_ttft_slo`). 0: no SLO (the
    router's default; ``kvpilot fleet up`` sets one, docs/concepts/policies.md)."""
    max_retries: int = 1
    """A request whose decode worker failed before anything reached the client
    (no answer, 5xx, timeout) is tried again this many times on other decode workers."""
    circuit_failures: int = 3
    """Consecutive failures (no answer, timeout, 5xx) that open a worker's circuit; 0: off."""
    circuit_open_s: float = 10.0
    """How long an open circuit keeps a worker out of routing before it is tried again."""
    api_key_env: str = ""
    """The environment variable holding the router's API key (``""``: no key). With a
    key, every endpoint except ``/health`` and ``/metrics`` needs
    ``Authorization: Bearer <key>``. Named, not stored, so no config file or command
    line carries the secret."""

    admin_token_env: str = ""
    """The environment variable (or ``<it>_FILE``, :func:`read_secret`) holding the admin
    token that the admin endpoints (``POST /debug/route``, ``GET /debug/fleet``) need
    (``Authorization: Bearer <token>``), from any address; the client API key does not open
    them. ``""``: they answer only a loopback peer (an operator on the router's host), with the
    API key if one is set."""

    engine_api_key_env: str = ""
    """The environment variable holding the engines' API key (vLLM's ``--api-key``),
    sent to every engine as ``Authorization: Bearer <key>``; ``""``: none."""
    calibration_prompt_tokens: list[int] = msgspec.field(default_factory=lambda: [256, 1024, 4096])
    """Before it serves, the router times a prefill of each of these lengths from nothing,
    and of a few tokens after each (:mod:`kvpilot.routing.serve.calibrate`); lengths over
    ``max_prompt_tokens`` are skipped."""
    calibration_decode_streams: list[int] = msgspec.field(default_factory=lambda: [1, 4])
    """Before it serves, the router times decode steps with each of these numbers of streams."""
    workers_file: str = ""
    """A YAML file listing the engines (a list of ``workers`` entries) that the router reads at
    start and again whenever it changes (every ``workers_poll_s``): engines join and leave with
    no restart, as an operator or an autoscaler edits it (the top-level ``workers`` must then be
    empty). A file that does not parse, or lists no fleet, is refused at start and, later, logged
    and ignored (the fleet stays as it was). Empty: ``workers`` is the fleet."""
    workers_poll_s: float = 2.0
    """How often ``workers_file`` is checked for a change."""
    calibration_workers: int = 0
    """Workers calibrated per role (prefill, decode, co-located) before the router serves, the
    fleet's first: the others are predicted from them (one model) until their own traffic is
    timed. 0: no calibration (the router's default; ``kvpilot fleet up`` sets 1)."""

    def __post_init__(self) -> None:
        check_range(self, "port", at_least=0, below=65536)
        check_range(
            self,
            "engine_metrics_interval_s",
            "max_prompt_tokens",
            "max_output_tokens",
            "max_model_len",
            "max_concurrent_requests",
            "max_queued_requests",
            "circuit_failures",
            "max_retries",
            "ttft_slo_s",
            at_least=0,
        )
        check_range(self, "max_body_bytes", at_least=1024)
        check_range(
            self,
            "queue_timeout_s",
            "circuit_open_s",
            "prefill_timeout_s",
            "request_timeout_s",
            "workers_poll_s",
            above=0,
        )
        check_range(self, "calibration_workers", at_least=0)
        check_range(self, "max_logprobs", at_least=-1)
        for key in ("calibration_prompt_tokens", "calibration_decode_streams"):
            if any(n < 1 for n in getattr(self, key)):
                raise ConfigError(key, f"must hold positive counts, got {getattr(self, key)}")
