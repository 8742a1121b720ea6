#!/usr/bin/env bash
# Flower's fixed cost per message round trip: the demo config on 3 real SuperNodes on loopback
# (`feddomain flower local`, warm executor) against the same config in the in-process simulator.
# Prints each round's train (send -> every reply in -> aggregated) and evaluate times side by
# side from rounds.jsonl, their medians, and the deployment's overhead per round trip; checks
# that both runs wrote the same metrics.
#   bash benchmarks/flower_roundtrip.sh [WORKDIR]
# LOCAL_OPTS and RUN_OPTS add options to `feddomain flower local` and `feddomain flower run`:
#   LOCAL_OPTS="--node-poll 0.05" bash benchmarks/flower_roundtrip.sh   # fast-polling SuperNodes
#   RUN_OPTS="--poll-interval 0.2" bash benchmarks/flower_roundtrip.sh  # the ServerApp's old pull
set -euo pipefail
work=$(realpath -m "${1:-/tmp/feddomain-roundtrip}")
read -ra local_opts <<< "${LOCAL_OPTS:-}"
read -ra run_opts <<< "${RUN_OPTS:-}"
rm -rf "$work" && mkdir -p "$work"
set -- configs/demo.yaml rounds=6 'split.targets=[grey]' eval.every=1 checkpoint.every=0
feddomain run "$@" --out "$work/sim" --quiet
feddomain flower local --nodes 3 --workdir "$work/fl" ${local_opts[@]+"${local_opts[@]}"} > "$work/local.log" 2>&1 &
local_pid=$!
trap 'kill -TERM $local_pid 2>/dev/null; wait $local_pid 2>/dev/null || true' EXIT  # a background job ignores SIGINT
until grep -q "flwr-home" "$work/local.log"; do
  kill -0 $local_pid 2>/dev/null || { cat "$work/local.log"; exit 1; }
  sleep 1
done
feddomain flower run "$@" --out "$work/flower" --flwr-home "$work/fl/flwr-home" \
  ${run_opts[@]+"${run_opts[@]}"} > "$work/run.log" 2>&1
python - "$work/sim" "$work/flower" <<'PY'
import json, statistics, sys

def rounds(d):
    return [json.loads(x) for x in open(f"{d}/rounds.jsonl")]

def metrics(d):
    return [{k: v for k, v in json.loads(x).items() if k != "time"}
            for x in open(f"{d}/metrics.jsonl")]

sim, fl = rounds(sys.argv[1]), rounds(sys.argv[2])
train = lambda r: r["time"]["train"] + r["time"]["aggregate"]
evaluate = lambda r: r["time"].get("evaluate", float("nan"))
print(f"{'round':>5} {'sim train':>10} {'flower train':>13} {'sim eval':>9} {'flower eval':>12}")
for s, f in zip(sim, fl, strict=True):
    print(f"{s['round']:>5} {train(s):>10.3f} {train(f):>13.3f} {evaluate(s):>9.3f} {evaluate(f):>12.3f}")
med = lambda rs, f: statistics.median(f(r) for r in rs)
ts, tf, es, ef = med(sim, train), med(fl, train), med(sim, evaluate), med(fl, evaluate)
print(f"{'median':>5} {ts:>10.3f} {tf:>13.3f} {es:>9.3f} {ef:>12.3f}")
print(f"overhead per round trip: train {tf - ts:.2f} s, evaluate {ef - es:.2f} s "
      f"(ratio {tf / ts:.1f}x, {ef / es:.1f}x)")
assert metrics(sys.argv[1]) == metrics(sys.argv[2]), "the deployed run's metrics differ"
print("metrics.jsonl equal (phase times aside)")
PY
