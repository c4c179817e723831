#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Short `vllm serve` smoke test of the HiSparse-safe FlashInfer all-reduce:
# start a TP server with HiSparse and dummy weights, check that the start-up
# line chose trtllm (single node), then run one wave that must complete in
# full. Needs NVIDIA GPUs; the model's config is fetched from the Hub.
set -euo pipefail

MODEL=${MODEL:-deepseek-ai/DeepSeek-V3.2}
TP=${TP:-4}
PORT=${PORT:-8000}
LOG=$(mktemp -t hisparse-serve-XXXX.log)
RESULTS=$(mktemp -d -t hisparse-waves-XXXX)

vllm serve "$MODEL" \
    --tensor-parallel-size "$TP" \
    --port "$PORT" \
    --load-format dummy \
    --hf-overrides '{"num_hidden_layers": 2}' \
    --max-model-len 8192 \
    --kv-transfer-config '{"kv_connector":"HiSparseConnector","kv_role":"kv_both","kv_connector_extra_config":{"host_pool_gib":8}}' \
    >"$LOG" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true' EXIT

for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    kill -0 $SERVER 2>/dev/null || { cat "$LOG"; echo "server exited"; exit 1; }
    sleep 1
done
curl -sf "http://127.0.0.1:$PORT/health" >/dev/null || { cat "$LOG"; exit 1; }

grep "FlashInfer all-reduce backend for ranks" "$LOG"
grep -q "FlashInfer all-reduce backend for ranks .*: trtllm" "$LOG"

vllm bench serve --model "$MODEL" --port "$PORT" --dataset-name random \
    --random-input-len 2048 --random-output-len 256 \
    --num-prompts 16 --max-concurrency 16 --ignore-eos \
    --save-result --save-detailed --result-dir "$RESULTS" \
    --result-filename wave-1.json
python3 benchmarks/check_waves.py --output-len 256 "$RESULTS/wave-1.json"
curl -sf "http://127.0.0.1:$PORT/health" >/dev/null || { cat "$LOG"; echo "server down after the wave"; exit 1; }
