"""Command-line tools: the demo, offline comparison runs."""
