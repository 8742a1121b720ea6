#!/usr/bin/env bash
# 100 clients on Flower's simulation engine (Ray: 100 virtual SuperNodes) against the in-process
# simulator, both started the way a user starts them: `feddomain run` and `feddomain flower local
# --simulation` + `feddomain flower run`. The demo config (embedded digits, target grey) with
# Bai et al.'s lambda split into 100 clients, 2 rounds; prints both wall times and compares every
# evaluated metric (accuracy, ECE, NLL, Brier, calibration bins, per-client accuracy) exactly.
#   bash benchmarks/flower_simulation_100.sh [WORKDIR]
set -euo pipefail
work=$(realpath -m "${1:-/tmp/feddomain-ray100}")
rm -rf "$work" && mkdir -p "$work"
set -- configs/demo.yaml rounds=2 'split.targets=[grey]' checkpoint.every=0 \
  train.batch_size=128 partition.name=lambda partition.n_clients=100 partition.lam=0.1 eval.every=2
start=$(date +%s.%N)
feddomain run "$@" --out "$work/sim" --quiet
sim_s=$(echo "$(date +%s.%N) - $start" | bc)
feddomain flower local --simulation --workdir "$work/fl" > "$work/local.log" 2>&1 &
local_pid=$!
trap 'kill -TERM $local_pid 2>/dev/null; wait $local_pid 2>/dev/null || true' EXIT  # a background job ignores SIGINT
until grep -q "flwr-home" "$work/local.log"; do sleep 1; done
start=$(date +%s.%N)
feddomain flower run "$@" --out "$work/ray" --flwr-home "$work/fl/flwr-home" \
  --federation-config 'num-supernodes=100 client-resources-num-cpus=1' > "$work/ray.log" 2>&1
ray_s=$(echo "$(date +%s.%N) - $start" | bc)
python - "$work/sim" "$work/ray" <<'PY'
import json, sys
def records(d):
    return [{k: v for k, v in json.loads(x).items() if k != "time"}
            for x in open(f"{d}/metrics.jsonl")]
sim, ray = records(sys.argv[1]), records(sys.argv[2])
assert sim == ray, "the deployed run's metrics differ from the simulator's"
print(f"metrics equal over {len(sim)} evaluated rounds, "
      f"{len(sim[-1]['per_client']['id_acc'])} clients")
PY
echo "simulator ${sim_s} s; Flower simulation engine (100 virtual SuperNodes) ${ray_s} s"
