#!/usr/bin/env bash
# The GPU checks of issue 27 in one pass, for a CUDA machine that has PyTorch but not feddomain's
# other dependencies and no network: pure wheels carried in .whl/ are installed into /tmp/site
# (pydantic, mlxtend, POT, finch-clust; Flower is not carried, so its tests are left out).
# Writes logs and JSON under $OUT (default: ./gpu-out). Order: the timings first, on an idle
# machine; then the full suite and the per-method table side by side (correctness only).
#
#   bash benchmarks/gpu_session.sh
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
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), torch.cuda.get_device_name())"
  nproc
} 2>&1 | tee "$out/machine.txt"

echo "== CUDA tests (tests/test_device.py, tests/test_augment.py)"
timeout 120 python3 -m pytest -p no:cacheprovider tests/test_device.py tests/test_augment.py \
  -v -rs 2>&1 | tee "$out/cuda_tests.log" | grep -E "PASS|FAIL|ERROR|SKIP|passed|failed" | tail -60

echo "== batched vs sequential client training (LeNet-5, hFedF CNN)"
for model in lenet5 hfedf_cnn; do
  timeout 150 python3 benchmarks/batched_clients.py --device cuda --clients 10 100 \
    --model "$model" 2>&1 | tee -a "$out/batched.log"
done

echo "== one round, CPU (16 threads) vs GPU"
timeout 60 python3 benchmarks/device_round.py --threads "$(nproc)" --models hfedf_cnn \
  --images 512 2>&1 | tee "$out/device_round.log"
timeout 120 python3 benchmarks/device_round.py --threads "$(nproc)" --models resnet18 \
  --images 128 2>&1 | tee -a "$out/device_round.log"

echo "== every method: cpu / cuda / cuda-bf16, and the whole suite (no Flower), side by side"
timeout 330 python3 benchmarks/cuda_methods.py --out "$out/cuda_methods.json" \
  >"$out/cuda_methods.log" 2>&1 &
methods=$!
timeout 330 python3 -m pytest -p no:cacheprovider -q -n 12 -rfEs \
  --ignore tests/test_flower.py --ignore tests/test_flower_roundtrip.py \
  --ignore tests/test_flower_safety.py --ignore tests/test_stations.py \
  --deselect "tests/test_ood_model.py::test_the_unseen_domain_model_on_flower_equals_the_simulator" \
  >"$out/suite.log" 2>&1
echo "suite rc $?"
wait "$methods"
echo "methods rc $?"
cat "$out/cuda_methods.log" | grep -v "^    File\|^      " | head -80
tail -40 "$out/suite.log"
