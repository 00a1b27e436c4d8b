#!/usr/bin/env bash
# Prefill/decode disaggregation on Ray Serve LLM (ray[serve]==2.60.0): prefill and decode
# replicas of MODEL, each its own vLLM engine with DHiSparseConnector (kv_producer /
# kv_consumer), behind one OpenAI server on 127.0.0.1:PORT.
#
#   MODEL=/path/to/model bash examples/ray_pd.sh            # a local Ray cluster
#   MODEL=... ADDRESS=auto PREFILL_RESOURCE=prefill_node DECODE_RESOURCE=decode_node \
#     bash examples/ray_pd.sh --gpus 1 --prefill-config '{"handoff_host": "auto"}'
#
# ADDRESS           Ray cluster to join (unset: start a local one)
# PREFILL_REPLICAS  default 1;  DECODE_REPLICAS  default 1
# PREFILL_RESOURCE / DECODE_RESOURCE  custom node resources that place each role
#                   (`ray start ... --resources '{"decode_node": 1}'` on those nodes)
# DECODE_CONFIG     kv_connector_extra_config of the decode side (JSON, default {})
# More arguments go to `vllm-dhisparse ray-pd` (`--help` lists them).  Then:
#   curl 127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
#     -d '{"model": "'$MODEL'", "prompt": "Hello", "max_tokens": 16}'
set -euo pipefail
: "${MODEL:?set MODEL to a DeepSeek-V4-architecture model}"
args=("$MODEL" --host 127.0.0.1 --port "${PORT:-8000}"
      --prefill-replicas "${PREFILL_REPLICAS:-1}" --decode-replicas "${DECODE_REPLICAS:-1}"
      --decode-config "${DECODE_CONFIG:-{\}}")
[ -n "${PREFILL_RESOURCE:-}" ] && args+=(--prefill-resource "$PREFILL_RESOURCE")
[ -n "${DECODE_RESOURCE:-}" ] && args+=(--decode-resource "$DECODE_RESOURCE")
if [ -n "${ADDRESS:-}" ]; then
  args+=(--address "$ADDRESS")
else
  export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0  # a local cluster: every node reports 127.0.0.1
fi
exec vllm-dhisparse ray-pd "${args[@]}" "$@"
