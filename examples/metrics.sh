#!/usr/bin/env bash
# Prometheus for the DHiSparse Grafana dashboard: scrapes vLLM servers that run
# DHiSparseConnector (their /metrics carry vllm:dhisparse_* next to vLLM's own).
#
#   TARGETS=127.0.0.1:8000 bash examples/metrics.sh      # after examples/serve.sh
#
# TARGETS          comma-separated host:port of vLLM API servers (default 127.0.0.1:8000)
# PROM_PORT        Prometheus' port on 127.0.0.1 (default 9090)
# SCRAPE_INTERVAL  default 5s (as grafana/prometheus.yml; the dashboard's rates assume
#                  the data source's timeInterval equals it)
# DATA_DIR         Prometheus' data and the generated config (default: a new temp dir)
# PROMETHEUS       the prometheus binary (default: the one on PATH; Debian: apt install
#                  prometheus)
#
# Grafana, provisioned from this repository (data source "Prometheus" at
# http://localhost:9090 and the dashboard grafana/dhisparse.json):
#   sudo cp grafana/provisioning/datasources/prometheus.yml /etc/grafana/provisioning/datasources/
#   sudo cp grafana/provisioning/dashboards/dhisparse.yml /etc/grafana/provisioning/dashboards/
#   sudo mkdir -p /var/lib/grafana/dashboards/vllm-dhisparse
#   sudo cp grafana/dhisparse.json /var/lib/grafana/dashboards/vllm-dhisparse/
#   sudo systemctl restart grafana-server     # dashboard "vLLM / DHiSparse KV hierarchy"
set -euo pipefail
PROMETHEUS=${PROMETHEUS:-prometheus}
command -v "$PROMETHEUS" >/dev/null || { echo "prometheus not found (apt install prometheus)" >&2; exit 1; }
DATA_DIR=${DATA_DIR:-$(mktemp -d -t dhisparse-prometheus-XXXXXX)}
INTERVAL=${SCRAPE_INTERVAL:-5s}
mkdir -p "$DATA_DIR"
{
  printf 'global:\n  scrape_interval: %s\n  evaluation_interval: %s\n' "$INTERVAL" "$INTERVAL"
  printf 'scrape_configs:\n  - job_name: vllm\n    metrics_path: /metrics\n    static_configs:\n      - targets:\n'
  IFS=, read -ra hosts <<< "${TARGETS:-127.0.0.1:8000}"
  for t in "${hosts[@]}"; do printf "          - '%s'\n" "$t"; done
} > "$DATA_DIR/prometheus.yml"
echo "prometheus on http://127.0.0.1:${PROM_PORT:-9090}, config $DATA_DIR/prometheus.yml" >&2
exec "$PROMETHEUS" --config.file="$DATA_DIR/prometheus.yml" --storage.tsdb.path="$DATA_DIR/tsdb" \
  --web.listen-address="127.0.0.1:${PROM_PORT:-9090}"
