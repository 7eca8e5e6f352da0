"""The routing decision and each request's booking, with no I/O: Dynamo's cost function
(``cost``), the router's own load accounting (``ledger``), sessions and D's offers
(``sessions``) and what replicas share of them (``session_record``), the sessions living on
each worker (``residency``), the measured rates (``rates``) and a path's predicted TTFT
(``measured_prices``), the decision itself (``router``: the (P, D) pair, local or remote
prefill, the article's five options for a session's next step; what it returns, ``route``; its
candidates' rows, ``candidate_rows``; a chosen pair's prices, ``session_step``; what it builds
from the config, ``from_config``) and one request's life as a state machine (``lifecycle``).
No clock of their own: callers pass ``now``, and the lifecycle reads the
:class:`~kvpilot.routing.decide.lifecycle.Clock` it is given. ``README.md`` says how to read the package.
"""
