"""Connector metrics through vLLM's own path: the metric table, the worker's collector,
the API server's Prometheus metrics."""
