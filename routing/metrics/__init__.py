"""What the router exports to Prometheus: its own series (``router_metrics``) and each
component's scrape-time collector (``collectors``).
"""
