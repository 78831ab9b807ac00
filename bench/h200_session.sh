#!/usr/bin/env bash
# One lent H200 call of the benches that wait for a GPU (issues 39, 40, 44), each under its own time limit so that
# what finished comes back in $OUT. Usage on the device (repo root, .whl carried): bash bench/h200_session.sh PART
#   PART 1: bench/oom_split.py, then bench/forward_kernels.py on the two MoE shapes
#   PART 2: bench/forward_kernels.py on the MLA and hybrid shapes, then `pytest -m gpu tests/test_kernels.py`
#   PART 3: bench/offload.py on the Qwen3-32B shape
#   PART 4: bench/oom_split.py, then bench/forward_kernels.py --only-chosen on the Qwen3-30B-A3B and DeepSeek-V3 shapes
set -u
source bench/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" >> "$OUT/gpu.txt" 2>&1
date -u >> "$OUT/gpu.txt"
case "${1:-1}" in
1)
  timeout 200 python3 bench/oom_split.py --work /tmp/boom --tokens 300000 > "$OUT/oom.txt" 2>&1; echo "oom exit $?" >> "$OUT/gpu.txt"
  timeout 360 python3 bench/forward_kernels.py --work /tmp/fk --case gpt_oss_20b,qwen3_30b_a3b --tokens 100000 \
    --out "$OUT/fk1.json" > "$OUT/fk1.txt" 2>&1; echo "fk1 exit $?" >> "$OUT/gpu.txt"
  ;;
2)
  timeout 420 python3 bench/forward_kernels.py --work /tmp/fk --case deepseek_v3_cut,qwen36_27b --tokens 100000 \
    --out "$OUT/fk2.json" > "$OUT/fk2.txt" 2>&1; echo "fk2 exit $?" >> "$OUT/gpu.txt"
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py > "$OUT/gpu_tests.txt" 2>&1; echo "gpu tests exit $?" >> "$OUT/gpu.txt"
  ;;
3)
  timeout 560 python3 bench/offload.py --work /tmp/bo --case qwen3_32b --tokens 400000 --out "$OUT/offload.json" \
    > "$OUT/offload.txt" 2>&1; echo "offload exit $?" >> "$OUT/gpu.txt"
  ;;
4)
  timeout 190 python3 bench/oom_split.py --work /tmp/boom --tokens 300000 > "$OUT/oom.txt" 2>&1; echo "oom exit $?" >> "$OUT/gpu.txt"
  timeout 210 python3 bench/forward_kernels.py --work /tmp/fk --case qwen3_30b_a3b --only-chosen --tokens 100000 \
    --out "$OUT/fk_qwen3_moe.json" > "$OUT/fk_qwen3_moe.txt" 2>&1; echo "fk qwen3_30b_a3b exit $?" >> "$OUT/gpu.txt"
  timeout 150 python3 bench/forward_kernels.py --work /tmp/fk --case deepseek_v3_cut --only-chosen --tokens 100000 \
    --out "$OUT/fk_dsv3.json" > "$OUT/fk_dsv3.txt" 2>&1; echo "fk deepseek_v3_cut exit $?" >> "$OUT/gpu.txt"
  ;;
esac
date -u >> "$OUT/gpu.txt"
for f in $(find /tmp/boom /tmp/fk /tmp/bo -name '*.log' -size -1M 2>/dev/null); do cp "$f" "$OUT/$(echo "${f#/tmp/}" | tr / _)"; done
exit 0
