#!/usr/bin/env bash
# Issue 14's table: PACS LODO with EfficientNet-Lite0 (packaged ImageNet weights) at the CPU
# budget of configs/fedfd/pacs_effnet64_budget.yaml, every method under one protocol: FedAvg, SiloBN,
# FedBN, MixStyle (after block groups 2-4), FedDG-GA, FedFD and FedFD-A (each FedFD model also
# scored under every test mode, benchmarks/fedfd_test_modes.py), and FedFD's training mixes
# u = 0, 0.5, 1 against random u (the poster's mixing and test-time tables).
#   scripts/fedfd_pacs_effnet64_budget.sh DATA_ROOT OUT [TARGETS] [SEED]
# e.g. scripts/fedfd_pacs_effnet64_budget.sh ../shared/data runs/effnet64 "sketch" 0; then
#   feddomain report OUT/runs --out OUT/report --metrics worst_client_acc
set -euo pipefail
root=${1:?data root}; out=${2:?output folder}
targets=${3:-"art_painting cartoon photo sketch"}; seed=${4:-0}
config=configs/fedfd/pacs_effnet64_budget.yaml
fd="algorithm=fedfd algorithm.lambda_feature=0.00078125"  # FedFD-A's λ_F, without the adapter
# run folder, runner (run: feddomain run; modes: with every test mode scored), overrides
methods=("fedavg run algorithm=fedavg" "silobn run algorithm=silobn" "fedfd modes $fd"
  "fedfd_a modes" "fedbn run algorithm=fedbn" "mixstyle run algorithm=mixstyle algorithm.blocks=[2,3,4]"
  "feddg_ga run algorithm=feddg_ga" "fedfd_u0 run $fd algorithm.u=0" "fedfd_u0.5 run $fd algorithm.u=0.5"
  "fedfd_u1 run $fd algorithm.u=1")
for target in $targets; do
  for entry in "${methods[@]}"; do
    read -r name runner extra <<<"$entry"
    dir="$out/runs/$name/seed$seed/$target"
    [ -f "$dir/summary.json" ] && continue
    rm -rf "$dir"  # an interrupted run restarts (its budget is minutes)
    mkdir -p "$(dirname "$dir")"
    common=(dataset.root="$root" split.targets="[$target]" seed="$seed")
    if [ "$runner" = modes ]; then
      python benchmarks/fedfd_test_modes.py "$config" "${common[@]}" $extra --out "$dir" \
        > "$dir.modes.log"
    else
      python -m feddomain.cli run "$config" "${common[@]}" $extra --out "$dir" --quiet
    fi
  done
done
