#!/usr/bin/env bash
# Flower's fixed cost per message round trip: the demo config on 3 real SuperNodes on loopback
# (`feddomain flower local`, warm executor) against the same config in the in-process simulator.
# Prints each round's train (send -> every reply in -> aggregated) and evaluate times side by
# side from rounds.jsonl, their medians, and the deployment's overhead per round trip; checks
# that both runs wrote the same metrics.
#   bash benchmarks/flower_roundtrip.sh [WORKDIR]
# LOCAL_OPTS and RUN_OPTS add options to `feddomain flower local` and `feddomain flower run`:
#   LOCAL_OPTS="--node-poll 0" bash benchmarks/flower_roundtrip.sh      # Flower's own 3 s idle poll
#   RUN_OPTS="--poll-interval 0.2" bash benchmarks/flower_roundtrip.sh  # the ServerApp's old pull
# With FLWR_LOG_LEVEL=DEBUG (timestamps in the SuperNodes' logs) it also splits each round trip
# into the ClientApp's own time (node received the message -> node sends the reply, the slowest
# node) and the rest: Flower's polls and transport.
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
until grep -qs "flwr-home" "$work/local.log"; do
  kill -0 $local_pid 2>/dev/null || { cat "$work/local.log"; exit 1; }
  sleep 1
done
feddomain flower run "$@" --out "$work/flower" --flwr-home "$work/fl/flwr-home" \
  ${run_opts[@]+"${run_opts[@]}"} > "$work/run.log" 2>&1
python - "$work/sim" "$work/flower" "$work/fl" <<'PY'
import json, re, statistics, sys
from datetime import datetime
from pathlib import Path

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

def clientapp_spans(log):
    """(round, message type) -> seconds from 'Received successfully' to 'Sending:'."""
    spans, key, received = {}, None, None
    stamp = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")
    for line in log.read_text(errors="replace").splitlines():
        when = stamp.search(line)
        if when is None:
            continue
        t = datetime.strptime(when.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if m := re.search(r"ROUND (\d+)\]", line):
            rnd = int(m.group(1))
        elif m := re.search(r"Receiving: (\w+) message", line):
            key = (rnd, m.group(1))
        elif "Received successfully" in line:
            received = t
        elif "Sending:" in line and key is not None and received is not None:
            spans[key] = t - received
            key = received = None
    return spans

nodes = [clientapp_spans(p) for p in sorted(Path(sys.argv[3]).glob("supernode*.log"))]
if any(nodes):
    print("ClientApp time (slowest node) and the rest of each round trip (polls, transport):")
    rest = {"train": [], "evaluate": []}
    for f in fl:
        for kind, total in (("train", f["time"]["train"]), ("evaluate", evaluate(f))):
            app = max(n.get((f["round"], kind), float("nan")) for n in nodes)
            rest[kind].append(total - app)
            print(f"  round {f['round']} {kind:>8}: total {total:.2f} s, ClientApp {app:.2f} s, "
                  f"rest {total - app:.2f} s")
    for kind, values in rest.items():
        print(f"  median rest per {kind} round trip: {statistics.median(values):.2f} s")
assert metrics(sys.argv[1]) == metrics(sys.argv[2]), "the deployed run's metrics differ"
print("metrics.jsonl equal (phase times aside)")
PY
