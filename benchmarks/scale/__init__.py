"""The scale benchmark's pieces: reading Prometheus histograms, index memory (``bench_router_scale.py``)."""
