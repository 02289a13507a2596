#!/usr/bin/env bash
# On one GPU (BENCHMARKS.md, "On one GPU"): this package's wheel installed in the device's
# Python (start-up activation, as users get it; nothing imported by hand), NVRx 0.6.0 and 0.7.0
# beside it. Expects in .whl/ (carried): nvrx_ipc_fix's wheel, wrapt, packaging, defusedxml,
# pytest and pytest-xdist with theirs, NVRx 0.6.0 and 0.7.0 (cp312); in .upstream/v060 and
# .upstream/v070 NVRx's own tests/checkpointing (tag v0.6.0; main d8686d9, the nearest to 0.7.0).
#   bash benchmarks/device_one_gpu.sh tests    # two queues at 2 GiB, torn CPU tensors and
#                                              # aborts on CUDA; NVRx's own tests with the
#                                              # package and with it off; then alone
#                                              # tests/gpu/test_reliability_gpu.py (9 min)
#   bash benchmarks/device_one_gpu.sh suspend16 # suspend, then flush, at 16 GiB (64 tensors)
#                                               # alone, five cycles each, then the snapshot's
#                                               # cost on this host (cpu_snapshot_cost.py)
#   bash benchmarks/device_one_gpu.sh suspend32 # the same at 32 GiB (256 tensors), no snapshot
# Writes pytest's output and JSON lines to $OUT (8 files at most).
# PHASE1_S and RELIABILITY_S (seconds) bound the phases where device time is short.
set -u
OUT=${OUT:-.}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/nvrx_ipc_fix-*.whl \
    .whl/wrapt-*.whl .whl/packaging-*.whl .whl/defusedxml-*.whl .whl/pytest-*.whl \
    .whl/pytest_xdist-*.whl .whl/execnet-*.whl .whl/pluggy-*.whl .whl/iniconfig-*.whl || exit
for v in 0.6.0 0.7.0; do
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target /tmp/nvrx-$v .whl/nvidia_resiliency_ext-$v-*.whl || exit
done
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, torch, nvrx_ipc_fix; print(sys.version.split()[0], torch.__version__, nvrx_ipc_fix.status().source)"
  nproc; free -g | sed -n 2p; df -h /tmp | tail -1; date -u
  # docs/verify.md's samples: doctor and the status, NVRx 0.6.0 beside the wheel
  PYTHONPATH=/tmp/nvrx-0.6.0 python3 -m nvrx_ipc_fix doctor
  PYTHONPATH=/tmp/nvrx-0.6.0 python3 -m nvrx_ipc_fix; } > "$OUT/env.txt" 2>&1
case "${1:-tests}" in
tests)  # phase 1 (about 5 min): what shares the GPU well, both NVRx at once
    for v in 0.6.0 0.7.0; do
        tag=nvrx${v//./}
        # two queues with 2 GiB models (8 tensors of 256 MiB; the EMA-like second trainer 3 of
        # them), CPU tensors changed right after the schedule beside a CUDA tensor (the
        # default IPC mode), an abort from a second thread: this project's tests, on CUDA
        (cd tests && PYTHONPATH=/tmp/nvrx-$v NVRX_TESTS_NUMEL=$((1 << 26)) timeout ${PHASE1_S:-240} \
            python3 -m pytest -q -rA -p no:cacheprovider -n 3 test_two_queues.py \
            test_cpu_snapshot.py test_never_worse_abort.py) > "$OUT/gpu-tests-$tag.txt" 2>&1 &
        # NVRx's own async-checkpoint tests, with the package active and with it off
        for fix in on off; do
            ( cd .upstream/v${v//./} && export PYTHONPATH=/tmp/nvrx-$v LOCAL_RANK=0 RANK=0 \
                WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$((29500 + RANDOM % 1000))
              [ $fix = on ] || export NVRX_IPC_FIX_DISABLE=1
              timeout ${PHASE1_S:-240} python3 -m pytest -q -rA -p no:cacheprovider \
                tests/checkpointing/unit/test_async_save.py \
                tests/checkpointing/unit/test_async_writer.py
            ) > "$OUT/nvrx-own-tests-$tag-$fix.txt" 2>&1 &
        done
    done
    wait
    # phase 2 (about 4 min), alone on the GPU: they read the device's memory
    for v in 0.6.0 0.7.0; do
        (cd tests && PYTHONPATH=/tmp/nvrx-$v timeout ${RELIABILITY_S:-165} python3 -m pytest -q -rA \
            -p no:cacheprovider gpu/test_reliability_gpu.py) >> "$OUT/gpu-reliability.txt" 2>&1
    done ;;
suspend16|suspend32)  # alone, checkpoints in /dev/shm (the disk holds one): suspend, then flush
    size=${1#suspend}; spec=$([ "$size" = 16 ] && echo 16g64 || echo 32g256)
    { cat /proc/sys/kernel/numa_balancing; lscpu | grep -i numa; } >> "$OUT/env.txt" 2>&1
    for strategy in suspend flush; do  # a line per cycle as it ends, in case a bound cuts it
        TMPDIR=/dev/shm PYTHONPATH=tests:/tmp/nvrx-0.7.0 timeout ${SUSPEND_S:-255} \
            env RESTART_WAIT_PARTIAL="$OUT/one-gpu-${spec}-cycles.jsonl" \
            python3 benchmarks/restart_wait.py --sizes $spec --strategies $strategy --cycles 5 \
            --inference 3 --step 2 --timeout 200 --label alone \
            --out "$OUT/one-gpu-${spec}-nvrx070.jsonl" > /dev/null 2>> "$OUT/err-suspend.txt"
    done
    if [ "$size" = 16 ]; then  # the snapshot's cost on this host: its cores, CUDA's torch
        for v in 060 070; do
            printf '#!/bin/sh\nPYTHONPATH=/tmp/nvrx-%s:$PYTHONPATH exec python3 "$@"\n' \
                "${v:0:1}.${v:1:1}.${v:2:1}" > /tmp/py$v && chmod +x /tmp/py$v
        done
        timeout ${SNAPSHOT_S:-270} python3 benchmarks/cpu_snapshot_cost.py --nvrx060 /tmp/py060 \
            --nvrx070 /tmp/py070 --sizes ${SNAPSHOT_SIZES:-256M,1G,4G} --rounds 1 --saves 3 \
            --cases "${SNAPSHOT_CASES:-persistent,forked,plain}" \
            > "$OUT/cpu-snapshot-cost.jsonl" 2>> "$OUT/err-suspend.txt"
    fi ;;
esac
