#!/usr/bin/env bash
# FISC's acceptance comparison at a CPU budget (issue 13; fisc.md §8 "without pretrained
# weights"): FedAvg, FedSR, FedDG-GA, CCST, FPL, FISC and FISC-v3 (no contrastive term) on the
# profile of configs/fisc/pacs_lambda_cpu.yaml (PACS 32 px, 100 clients, lambda 0.1, 20% sampled,
# LeNet-5, 50 rounds), the four leave-two-domains-out schemes, the same seeds, partitions and
# initialisation for every method (all derive from the seed). Runs one after another, niced,
# one thread each; a finished run is skipped when the script is run again.
#   scripts/fisc_compare.sh DATA_ROOT OUT [SEEDS...]      e.g. scripts/fisc_compare.sh /data runs/fisc 0 1 2
#   METHODS="fedavg fisc" scripts/fisc_compare.sh /data runs/fisc 1   (a subset of the methods)
#   SCHEMES=lodo scripts/fisc_compare.sh /data runs/fisc 0   (leave-one-domain-out instead)
#   python scripts/fisc_table.py OUT                        (the LTDO table and §8's checks)
#   feddomain report OUT/<scheme>/*/* --selection last      (and --selection source_val)
set -euo pipefail
root=${1:?data root (the folder holding PACS/)}
out=${2:?output folder}
shift 2
seeds=("${@:-0}")
[ ${#seeds[@]} -eq 0 ] && seeds=(0)
config=configs/fisc/pacs_lambda_cpu.yaml
declare -A methods=(
  [fedavg]="algorithm=fedavg"
  [fedsr]="algorithm=fedsr"
  [feddg_ga]="algorithm=feddg_ga"
  [ccst]="algorithm=ccst"
  [fpl]="algorithm=fpl"
  [fisc]=""
  [fisc_v3]="algorithm.styled_loss=cross_entropy algorithm.label=fisc_v3"
)
read -ra order <<< "${METHODS:-fedavg fisc fisc_v3 ccst fpl fedsr feddg_ga}"
for seed in "${seeds[@]}"; do
  for scheme in ${SCHEMES:-cs-a-p ac-p-s ps-c-a pa-s-c}; do
    for m in "${order[@]}"; do
      dir="$out/$scheme/$m/s$seed"
      [ -f "$dir/summary.json" ] || [ -f "$dir/lodo-sketch/summary.json" ] && continue
      rm -rf "$dir"
      nice -n 10 python -m feddomain.cli run "$config" "dataset.root=$root" "split.scheme=$scheme" \
        "seed=$seed" ${methods[$m]} --out "$dir" --quiet
    done
  done
done
