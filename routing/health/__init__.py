"""Who is fit to serve, pure (the clock is passed in): each worker's circuit
(``circuit``), workers whose KV events stopped (``event_watch``), each (P, D) pair's
recent transfer failures and transfer time as a cost (``pair_health``).
"""
