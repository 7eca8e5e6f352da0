"""I/O: the router's session state in a store shared by its replicas and kept across
its restarts (``sessions.store``). :mod:`kvpilot.routing.state.redis_store` talks to Redis;
:mod:`kvpilot.routing.state.sync` reads a session's record before its step is routed and
writes it once the step was served, before the answer is returned. The record, its merge
rule and the store's contract are pure: :mod:`kvpilot.routing.decide.session_record`."""
