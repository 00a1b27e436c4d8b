"""Code that runs inside the model's forward, in the worker: the model class and its
routed c4a attention layers (CPU, CUDA), the per-step context they read."""
