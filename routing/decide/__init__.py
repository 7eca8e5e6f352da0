"""The routing decision, pure: Dynamo's cost function (``cost``), the router's own
load accounting (``ledger``), sessions and D's offers (``sessions``), and the decision
itself (``router``: the (P, D) pair, local or remote prefill, the article's five
options for a session's next step). No I/O, no clock read: callers pass ``now``.
"""
