"""Code that runs in vLLM's worker process around the forward: the worker class, the
connector's worker half (it owns the hierarchy), admission, pool sizing, the decode policy."""
