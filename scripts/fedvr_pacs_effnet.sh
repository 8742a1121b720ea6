#!/usr/bin/env bash
# Issue 15's acceptance table: PACS LODO, profile pacs-effnet-frozen (frozen EfficientNet-Lite0
# features at 128 px, adapter r = 64 + linear head, 3 clients), every method under one protocol:
# Local, FedAvg, FedProx (mu 1e-2), FedSR, pFedHN, hFedF and FedVR (zero-shot ood), and FedVR
# without its variance regulariser (lambda_var = 0: what the regulariser buys).
#   scripts/fedvr_pacs_effnet.sh DATA_ROOT OUT [TARGETS] [ROUNDS] [SEED]
# e.g. scripts/fedvr_pacs_effnet.sh ../shared/data runs/effnet "sketch" 200 0
# Features are computed once into OUT/cache and shared by every run. Then:
#   feddomain report OUT/runs --out OUT/report
set -euo pipefail
root=${1:?data root}; out=${2:?output folder}
targets=${3:-"art_painting cartoon photo sketch"}; rounds=${4:-200}; seed=${5:-0}
config=configs/fedvr/pacs_effnet_frozen.yaml
# run folder, method, extra overrides
methods=("fedvr fedvr" "fedvr_lambda0 fedvr algorithm.lambda_var=0" "fedavg fedavg" "hfedf hfedf"
  "local local" "fedprox fedprox algorithm.mu=0.01" "fedsr fedsr" "pfedhn pfedhn")
for target in $targets; do
  for entry in "${methods[@]}"; do
    read -r name method extra <<<"$entry"
    dir="$out/runs/$name/seed$seed/$target"
    [ -f "$dir/summary.json" ] || [ -f "$dir/lodo-$target/summary.json" ] && continue
    python -m feddomain.cli run "$config" dataset.root="$root" dataset.cache_dir="$out/cache" \
      split.targets="[$target]" rounds="$rounds" seed="$seed" algorithm="$method" $extra \
      --out "$dir" --quiet
  done
done
