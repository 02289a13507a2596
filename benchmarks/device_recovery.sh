#!/usr/bin/env bash
# The recovery protocol on one GPU, as users deploy it (BENCHMARKS.md, "Recovery after a
# worker failure"): the package's wheel installed (start-up activation by its .pth), NVRx
# 0.6.0 and 0.7.0, 2 GiB in 16 tensors, NCCL world size 1 (torchrun), and Megatron-LM PR
# #6971's tests on megatron-core 0.19.2. Expects in .whl/: this package's wheel, the two NVRx
# wheels, megatron-core 0.19.2, defusedxml; and the PR's test file at .upstream/ (see pr6971.py).
# Writes benchmarks/results-style JSON lines and pytest's output to $OUT (default: .).
set -u
OUT=${OUT:-.}
python3 -m pip install -q --no-index --no-deps --no-cache-dir .whl/nvrx_ipc_fix-*.whl || exit
for v in 0.6.0 0.7.0; do
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/nvrx-$v \
        .whl/nvidia_resiliency_ext-$v-*.whl .whl/defusedxml-*.whl || exit
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/mcore \
    .whl/megatron_core-0.19.2-*.whl || exit
python3 -m nvrx_ipc_fix doctor > "$OUT/doctor.txt" 2>&1
CASES=(--case "kill-idle=save,save,fault-idle,save" --case "kill-write=save,save,fault-kill,save"
       --case "segv-write=save,save,fault-segv,save" --case "twice=save,save,fault-kill,fault-kill,save")
G="python3 benchmarks/gpu_lifecycle.py --ranks 1 --launcher torchrun --sizes 2g16 --scenarios= --timeout 90"
for v in 0.6.0 0.7.0; do
    tag=nvrx${v//./}
    PYTHONPATH=/tmp/nvrx-$v $G --out "$OUT/h200-recovery-$tag.jsonl" "${CASES[@]}" > /dev/null 2>"$OUT/err-$tag.txt" &
    PYTHONPATH=/tmp/nvrx-$v $G --finalize poll --out "$OUT/h200-recovery-poll-$tag.jsonl" \
        --case "kill-idle=save,save,fault-idle,save" --case "kill-write=save,save,fault-kill,save" \
        > /dev/null 2>"$OUT/err-poll-$tag.txt" &
done
PYTHONPATH=/tmp/mcore:/tmp/nvrx-0.6.0 python3 benchmarks/pr6971.py .upstream/test_async_worker_failure.py \
    > "$OUT/pr6971-mcore0192.txt" 2>&1 &
wait
