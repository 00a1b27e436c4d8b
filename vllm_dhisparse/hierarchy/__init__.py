"""Engine-agnostic KV hierarchy core: imports torch, never vLLM."""
