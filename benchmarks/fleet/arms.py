"""The fleet benchmark's arms: who routes, with which options, on the same Dynamo
mocker fleet (:class:`kvpilot.deploy.dynamo_spec.DynamoFleetSpec`, restarted per arm). Pure.

* ``dynamo_round_robin``: Dynamo's frontend, ``--router-mode round-robin``.
* ``dynamo_kv``: Dynamo's own KV router in the frontend, ``--router-mode kv``, its defaults.
* ``dynamo_kv_tuned``: the same KV router with :data:`TUNED_FLAGS` (aggregated) or
  :data:`TUNED_DISAGG_FLAGS` (disaggregated), the documented options
  (``python -m dynamo.frontend --help``) that fit this workload.
* ``dynamo_kv_envoy``: the tuned KV router behind the same Envoy as kvpilot's arm, with a
  fixed route to the frontend (no picker, no filter but the router's; the same fresh upstream
  connection per request): kvpilot's gateway hop carried by Dynamo's arm too, so the picker's
  own share is the difference between the two.
* ``kvpilot``: ``kvpilot fleet up --dynamo``'s fleet: Envoy in front of the frontend in
  direct mode, asking kvpilot's picker (ext_proc) for each request's instances; Envoy
  carries the stream, the frontend only forwards. Its handicap: one more hop (client ->
  Envoy -> frontend), in compiled code, and the picker's decision before it.
* ``kvpilot_native``: ``kvpilot``'s fleet with the compiled picker in Envoy
  (``routing/native``): Envoy decides every token-id prompt itself (hash, match, Dynamo's cost,
  its own load bookings; no session terms) and asks the Python picker only for the rest.
* ``kvpilot_relay``: kvpilot's router itself in front of the frontend (no Envoy), relaying
  every streamed token in Python: the layout before the picker, kept to measure what
  leaving the token path bought.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from kvpilot.deploy.dynamo_spec import DynamoFleetSpec, FrontendRouting


class ArmName(str, enum.Enum):
    """The arms, as the JSON keys them."""

    DYNAMO_ROUND_ROBIN = "dynamo_round_robin"
    DYNAMO_KV = "dynamo_kv"
    DYNAMO_KV_TUNED = "dynamo_kv_tuned"
    DYNAMO_KV_ENVOY = "dynamo_kv_envoy"
    KVPILOT = "kvpilot"
    KVPILOT_NATIVE = "kvpilot_native"
    KVPILOT_RELAY = "kvpilot_relay"


TUNED_FLAGS = (
    "--router-track-output-blocks",
    "--router-kv-overlap-score-credit-decay",
    "1.0",
)
"""Dynamo 1.6.1's KV router options for this workload (long prompts, a few hundred
output tokens, bursts of arrivals on many workers), each documented in
``dynamo.frontend --help``:

* ``--router-track-output-blocks``: count the blocks a request's output adds to its
  worker's load as it decodes (off by default: a worker decoding long answers looks
  idle to the default router);
* ``--router-kv-overlap-score-credit-decay 1.0``: halve a worker's overlap credit at one
  request's worth of excess prefill load (0 by default: every request sharing a prefix
  herds onto the worker that holds it, however busy).

Session affinity and a request weight (:data:`SESSION_FLAGS`) are added where the trace
names sessions.
Not used: ``--router-prefill-load-model
ais`` (needs aisimulate, which does not install here), router queueing (the fleets are
not saturated at these rates: a queue only adds its wait), and conditional
disaggregation (``--router-conditional-disagg``): with it every request of a 2 P + 3 D
mocker fleet was a 503, the frontend warning that the decode workers publish no KV
events, which its conditional disaggregation requires (``dynamo.mocker`` decode workers
do not)."""

TUNED_DISAGG_FLAGS = ("--router-kv-overlap-score-credit-decay", "1.0")
""":data:`TUNED_FLAGS` for a disaggregated fleet, less ``--router-track-output-blocks``: with
it Dynamo 1.6.1's frontend fails to start its prefill router ("router_track_output_blocks
requires router_track_active_blocks=true", measured) and answers every request with a 503."""


SESSION_REQUEST_WEIGHT = 200
"""Blocks of cost per request a worker is running (Dynamo's ``decode_active_request_weight``,
the same name in kvpilot's ``cost``), on a trace whose requests name their sessions."""
SESSION_FLAGS = (
    "--router-session-affinity-ttl-secs",
    "300",
    "--router-decode-active-request-weight",
    str(SESSION_REQUEST_WEIGHT),
)
"""The tuned arm's options on a trace whose requests name their sessions (:mod:`agent_trace`'s):
spread the sessions, then pin them. Dynamo 1.6.1 binds a session (``x-dynamo-session-id``)
to the worker its first request went to, for 300 s after its last request (longer than any
gap between an agent's steps), in its default hard mode; the request weight sends a new
session to a worker serving none rather than beside another session on a worker that holds
the shared prefix. At the agent trace's quarter scale (``--tokens-per-hash 128``, blocks of
32) the shared prefix is 250 blocks, and a worker serving one session costs its whole history
less the prefix (about 125 blocks) more than an idle one that recomputes the prefix; 200
outweighs that, where Dynamo's default 0 and kvpilot's affinity alone herded the sessions onto
the few workers holding the prefix (2026-12-02: ITL 20.9 ms against 10.1 ms spread). The
weight is in blocks: a full-scale trace's prefix is 4x as many."""


@dataclass(frozen=True, slots=True)
class Arm:
    name: ArmName
    title: str
    routing: FrontendRouting
    frontend_flags: tuple[str, ...] = ()
    router_cost: tuple[tuple[str, object], ...] = ()
    """kvpilot's ``cost`` over its defaults (kvpilot's arms only)."""
    relay: bool = False
    """kvpilot's router relays the streams itself: no Envoy (``gateway_port`` 0)."""
    envoy_in_front: bool = False
    """Dynamo routes behind Envoy with a fixed route (:attr:`DynamoFleetSpec.envoy_in_front`)."""
    native_picker: bool = False
    """Envoy decides token-id prompts with the compiled picker (:attr:`DynamoFleetSpec.native_picker`)."""

    def spec(self, fleet: DynamoFleetSpec) -> DynamoFleetSpec:
        """``fleet`` (workers, ports, mocker options) with this arm's routing."""
        return dataclasses.replace(
            fleet,
            frontend_routing=self.routing,
            frontend_flags=self.frontend_flags,
            router_cost=self.router_cost,
            gateway_port=0 if self.relay else fleet.gateway_port,
            envoy_in_front=self.envoy_in_front,
            native_picker=self.native_picker,
        )


def arms(
    disaggregated: bool,
    tuned_flags: tuple[str, ...] | None = None,
    sessions: bool = False,
    kvpilot_cost: tuple[tuple[str, object], ...] | None = None,
) -> list[Arm]:
    """The arms in the order they run; ``tuned_flags`` replaces the tuned arm's flags
    (its default adds :data:`SESSION_FLAGS` where the requests name ``sessions``) and
    ``kvpilot_cost`` overrides kvpilot's cost (default: none; on a trace naming sessions
    kvpilot's own session terms spread them and keep them:
    :mod:`kvpilot.routing.decide.residency`)."""
    if tuned_flags is None:
        tuned_flags = TUNED_DISAGG_FLAGS if disaggregated else TUNED_FLAGS
        tuned_flags += SESSION_FLAGS if sessions else ()
    if kvpilot_cost is None:
        kvpilot_cost = ()
    return [
        Arm(ArmName.DYNAMO_ROUND_ROBIN, "Dynamo round robin", FrontendRouting.ROUND_ROBIN),
        Arm(ArmName.DYNAMO_KV, "Dynamo KV router (defaults)", FrontendRouting.KV),
        Arm(ArmName.DYNAMO_KV_TUNED, "Dynamo KV router (tuned)", FrontendRouting.KV, tuned_flags),
        Arm(
            ArmName.DYNAMO_KV_ENVOY,
            "Envoy (fixed route) -> Dynamo KV router (tuned)",
            FrontendRouting.KV,
            tuned_flags,
            envoy_in_front=True,
        ),
        Arm(
            ArmName.KVPILOT,
            "Envoy + kvpilot picker -> Dynamo frontend (direct)",
            FrontendRouting.DIRECT,
            (),
            kvpilot_cost,
        ),
        Arm(
            ArmName.KVPILOT_NATIVE,
            "Envoy + compiled picker (Python picker for the rest) -> Dynamo frontend (direct)",
            FrontendRouting.DIRECT,
            (),
            kvpilot_cost,
            native_picker=True,
        ),
        Arm(
            ArmName.KVPILOT_RELAY,
            "kvpilot router relaying -> Dynamo frontend (direct)",
            FrontendRouting.DIRECT,
            (),
            kvpilot_cost,
            relay=True,
        ),
    ]
