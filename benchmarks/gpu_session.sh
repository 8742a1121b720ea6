#!/usr/bin/env bash
# The GPU checks of issue 27, for a CUDA machine that has PyTorch but not feddomain's other
# dependencies and no network: pure wheels carried in .whl/ are installed into /tmp/site
# (pydantic, mlxtend, POT, finch-clust; Flower is not carried, so the tests that import it are
# left out). Writes logs and JSON under $OUT (default: ./gpu-out).
#
#   bash benchmarks/gpu_session.sh timings tests methods   # any of the three parts, in order
#
# timings: batched vs sequential clients, one round CPU vs GPU (first, on an idle machine);
# tests: the tests marked cuda and the rest of the suite (pinned to the CPU) side by side;
# methods: benchmarks/cuda_methods.py (every method on cpu / cuda / cuda-bf16), or only the
# methods named in $METHODS.
set -uo pipefail
out="${OUT:-gpu-out}"
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore::SyntaxWarning
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), torch.cuda.get_device_name())"
  nproc --all
} 2>&1 | tee "$out/machine.txt"
no_flower=(--ignore tests/test_flower.py --ignore tests/test_flower_roundtrip.py
  --ignore tests/test_flower_safety.py --ignore tests/test_stations.py
  --ignore tests/test_fedbn_silobn.py --ignore tests/test_hfedatm.py
  --ignore tests/test_unseen_domain.py --ignore tests/test_ood_model.py)

for part in "$@"; do
  case "$part" in
    timings)
      for model in lenet5 hfedf_cnn; do
        timeout 150 python3 benchmarks/batched_clients.py --device cuda --clients 10 100 \
          --model "$model" 2>&1 | tee -a "$out/batched.log"
      done
      timeout 60 python3 benchmarks/device_round.py --threads "$(nproc --all)" --models hfedf_cnn \
        --images 512 2>&1 | tee "$out/device_round.log"
      timeout 120 python3 benchmarks/device_round.py --threads "$(nproc --all)" --models resnet18 \
        --images 128 2>&1 | tee -a "$out/device_round.log"
      ;;
    tests)
      timeout 330 python3 -m pytest -p no:cacheprovider -m cuda -n 6 -v -rfEs "${no_flower[@]}" \
        >"$out/cuda_tests.log" 2>&1 &
      cuda_tests=$!
      timeout 330 python3 -m pytest -p no:cacheprovider -m "not cuda" -q -n 10 -rfE \
        "${no_flower[@]}" >"$out/suite.log" 2>&1
      echo "suite rc $?"
      wait "$cuda_tests"
      echo "cuda tests rc $?"
      grep -E "PASSED|FAILED|ERROR" "$out/cuda_tests.log" | sed 's/^\[gw[0-9]*\] //' | sort \
        | cut -c1-150 | head -100
      tail -3 "$out/cuda_tests.log"
      grep -E "^(FAILED|ERROR)" "$out/suite.log" | head -40
      tail -1 "$out/suite.log"
      ;;
    methods)
      # shellcheck disable=SC2086
      timeout 330 python3 benchmarks/cuda_methods.py --out "$out/cuda_methods.json" \
        ${METHODS:+--methods $METHODS} 2>&1 | grep -v "^    File\|^      " | tee "$out/cuda_methods.log"
      ;;
  esac
done
