"""What the router reads from its engines, on threads and tasks of its own: the ZMQ
KV-event subscriber with gaps, replay and restarts (``subscriber``), the thread that
feeds the index from every subscriber (``feeder``), and each engine's ``/metrics``
polled for load and NIXL transfer counters (``engine_metrics``).
"""
