#!/usr/bin/env bash
# The suspend strategy on one H200: its GPU tests and its benchmark against flush and
# restart (BENCHMARKS.md, "Suspend"). Expects in .whl/: the two NVRx wheels, defusedxml, wrapt
# and packaging (cp312). Writes pytest's output and benchmarks/results-style JSON lines to $OUT.
#   bash benchmarks/device_suspend.sh tests    # tests/gpu's suspend tests, NVRx 0.6.0 and 0.7.0
#   bash benchmarks/device_suspend.sh 2g       # 2g16: flush, restart, suspend (alone, in turn)
#   bash benchmarks/device_suspend.sh 8g       # 8g64: suspend, alone
#   bash benchmarks/device_suspend.sh 16g "S.." # 16g128: each strategy S at once (suspend flush)
#   bash benchmarks/device_suspend.sh cycles   # 20 cycles and steps without a save; then the
#                                              # resume beside a GPU-bound step against in line
# Each mode fits one 10-minute device call and writes at most 8 files.
set -u
OUT=${OUT:-.}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/wrapt-*.whl .whl/packaging-*.whl .whl/defusedxml-*.whl || exit
for v in 0.6.0 0.7.0; do
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target /tmp/nvrx-$v .whl/nvidia_resiliency_ext-$v-*.whl || exit
done
export PYTHONPATH=src:tests:/tmp/site PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "
import sys, torch; torch.zeros(1, device='cuda')
from nvrx_ipc_fix.worker import cuda_checkpoint as cc
driver, why = cc.load()
print(sys.version.split()[0], torch.__version__, 'driver API', driver and driver.version(), why)"
  df -h /tmp /dev/shm | tail -n +2; free -g | sed -n 2p; } > "$OUT/env.txt" 2>&1
W="python3 benchmarks/restart_wait.py --step 3 --timeout 120"
N7="env PYTHONPATH=$PYTHONPATH:/tmp/nvrx-0.7.0"; N6="env PYTHONPATH=$PYTHONPATH:/tmp/nvrx-0.6.0"
case "${1:-tests}" in
tests)  # 2 min 20 s, then the lock on a mapping worker
    for v in 0.6.0 0.7.0; do
        PYTHONPATH=$PYTHONPATH:/tmp/nvrx-$v python3 -m pytest -q -rA -p no:cacheprovider \
            tests/gpu/test_gpu.py -k "suspend or two_ranks" > "$OUT/gpu-tests-suspend-nvrx${v//./}.txt" 2>&1 &
    done
    wait
    $N7 timeout 150 python3 -m pytest -q -rA -p no:cacheprovider tests/gpu/test_gpu.py -k lock_on \
        > "$OUT/gpu-tests-lock-nvrx070.txt" 2>&1 ;;
2g)  # alone: 6 min
    $N7 $W --sizes 2g16 --strategies flush,restart,suspend --cycles 5 --inference 5 \
        --out "$OUT/h200-suspend-2g16-nvrx070.jsonl" > /dev/null 2> "$OUT/err-2g.txt" ;;
8g)  # alone: 4 min
    $N7 $W --sizes 8g64 --strategies suspend --cycles 5 --inference 5 --label alone \
        --out "$OUT/h200-suspend-8g64-alone-nvrx070.jsonl" > /dev/null 2> "$OUT/err-8g.txt" ;;
16g)  # 16g128, one stream per strategy (e.g. "suspend flush": at once, sharing the GPU and disk)
    for strategy in ${2:-suspend}; do
        $N7 $W --sizes 16g128 --strategies $strategy --cycles 5 --inference 5 \
            --out "$OUT/h200-suspend-16g128-$strategy-nvrx070.jsonl" > /dev/null 2> "$OUT/err-16g-$strategy.txt" &
    done
    wait ;;
cycles)  # 20 cycles (a save every third step) beside 3 steps without a save; then the matmul pair
    $N6 $W --sizes 2g16 --strategies suspend --cycles 20 --inference 3 --step 1 --save-every 3 \
        --label cycles20 --out "$OUT/h200-suspend-cycles20-nvrx060.jsonl" > /dev/null 2> "$OUT/err-c20.txt" &
    $N7 $W --sizes 8g64 --strategies suspend --cycles 3 --inference 3 --save-every 100 \
        --label nosave --out "$OUT/h200-suspend-nosave-nvrx070.jsonl" > /dev/null 2> "$OUT/err-nosave.txt" &
    wait
    $N7 $W --sizes 2g16 --strategies suspend,suspend-inline --matmuls 2000 --cycles 5 \
        --inference 5 --label matmul --out "$OUT/h200-suspend-inline-nvrx070.jsonl" > /dev/null 2> "$OUT/err-inline.txt" ;;
esac
