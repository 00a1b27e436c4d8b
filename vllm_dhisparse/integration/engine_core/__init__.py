"""Code that runs in vLLM's engine-core process: the scheduler class, the connector's
scheduler half, and the KV cache specs' block managers (c4a window, draft ring)."""
