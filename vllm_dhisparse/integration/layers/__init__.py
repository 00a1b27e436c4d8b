"""Code that runs inside the model's forward, in the worker: the model class and its routed
c4a attention layers (CPU, CUDA), the per-step context they read, the model probe, the
reader of vLLM's c4a cache and the failure isolation the step context uses."""
