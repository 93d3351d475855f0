#!/usr/bin/env bash
# `make demo`: the whole flow on an embedded default, on this machine's CPU.
#   1. estimate-memory: does Llama-2-7B fit on the FSDP seed's cluster (2 nodes x 4 A100-80GB)?
#   2. plan: FULL vs HYBRID, batch, checkpointing on that cluster with a 50 Gbps inter-node network
#   3. plan --gpu cpu, then launch: a tiny Llama planned for this machine's CPU and run for real (2 processes, FSDP2
#      on gloo, fp32) on the shipped corpus
set -euo pipefail
cd "$(dirname "$0")/.."
LLMCTL=${LLMCTL:-.venv/bin/llmctl}
say() { printf '\n\033[1m== %s ==\033[0m\n' "$*"; }

say "1/3  llmctl estimate-memory llama-2-7b on 2 x 4 A100-80GB (seq 1024, checkpointing, flash)"
"$LLMCTL" estimate-memory llama-2-7b --gpu A100-80GB --nodes 2 --gpus-per-node 4 --seq-len 1024 \
  --checkpointing full --attention flash

say "2/3  llmctl plan llama-2-7b on the seed's cluster (50 Gbps between nodes), 2B tokens"
mkdir -p runs/demo
"$LLMCTL" plan llama-2-7b --cluster examples/clusters/plan-a100-2x4-50gbps.yaml --seq-len 1024 --tokens 2B \
  -o runs/demo/llama-2-7b.plan.yaml --force

say "3/3  llmctl plan llama-tiny --gpu cpu (2 CPU processes), then llmctl launch it on the shipped corpus"
rm -rf runs/tiny-cpu-demo  # a fresh run each time (the engine would otherwise resume from its last checkpoint)
"$LLMCTL" plan llama-tiny --gpu cpu --gpus 2 --seq-len 128 --global-batch 16 --tokens 300k --data examples/corpus \
  --run-dir runs/tiny-cpu-demo -o runs/demo/tiny-cpu.plan.yaml --force --top 2
"$LLMCTL" launch runs/demo/tiny-cpu.plan.yaml
say "done: metrics in runs/tiny-cpu-demo/metrics.jsonl, checkpoints in runs/tiny-cpu-demo/checkpoints"
