"""Everything that imports vLLM: plugin entry point, connector, hooks."""
