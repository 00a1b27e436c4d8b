"""Code that runs in vLLM's engine-core process: the scheduler class and the connector's
scheduler half (the c4a window managers it feeds live in ``kv_spec.py``)."""
