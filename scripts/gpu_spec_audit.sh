#!/usr/bin/env bash
# The in-engine speculative audit, ngram and DSpark at once (K = 3, ~80 s on an H100), on a
# GPU machine staged with scripts/vllm_stage (stage.sh c1 ... c4, one device call each):
#
#   bash scripts/gpu_spec_audit.sh        # from the repo root, in the call after the last part
#
# Each run is scripts/gpu_connector.py --arms connector --audit --unaudited (the measuring
# subclass, which also lets a method the package does not serve yet be audited) over the batch,
# preempt and abort scenarios; DSpark's drafter replays the committed resident outputs of
# gpu_connector_2026-12-06_55ddba9.json, so that some drafts are accepted and some are not.
# Writes $OUT/spec_results.tar.gz (both gpu_connector.json files and logs, drafters left
# out) and $OUT/vstage_cache.tar.xz (the JIT cache, for stage.sh next time).
set -u
source scripts/vllm_stage/stage.sh .vstage_parts/none > /tmp/stage_env.log 2>&1
tail -1 /tmp/stage_env.log
EXTRA='{"hot_cache_rows":512,"optional_residency":false,"device_window_tokens":0}'
mkdir -p /tmp/res
COMMON=(--arms connector --audit --unaudited --extra "$EXTRA" --scenarios batch,preempt,abort
        --timeout 480)
python3 scripts/gpu_connector.py "${COMMON[@]}" --spec ngram --out /tmp/res/ngram \
  > /tmp/res/ngram.out 2>&1 &
python3 scripts/gpu_connector.py "${COMMON[@]}" --spec dspark --out /tmp/res/dspark \
  --spec-ref benchmarks/results/gpu_connector_2026-12-06_55ddba9.json > /tmp/res/dspark.out 2>&1 &
wait
grep -h SUMMARY /tmp/res/*.out
rm -rf /tmp/res/*/drafter_*
tar -C /tmp -czf "$OUT/spec_results.tar.gz" res
tar -C "$VSTAGE" -cJf "$OUT/vstage_cache.tar.xz" cache
