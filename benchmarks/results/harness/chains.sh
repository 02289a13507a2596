#!/usr/bin/env bash
# The whole measurement as it ran (three scripts, one after the other, here in one): each run
# applies one patch, runs the pair as CI does (run_pair.sh), and reverts. Run in a worktree of
# c9955ac with its envs made, the patches and run_pair.sh in $D.
set -u
P=py311-nvrx060-wrapt2,py311-nvrx070-wrapt2
M=py311-megatron-nvrx060-wrapt2,py311-bridge-nvrx060-wrapt2
N=py311-nonvrx-wrapt2,py311-ray-wrapt2
D=/work/wt-measure-patches
cd /work/wt-measure
run() {  # NAME ENVS [PATCH] [PRE...]
  local name=$1 envs=$2 patch=${3:-}
  shift 3 2>/dev/null || shift $#
  [ -n "$patch" ] && git apply "$D/$patch"
  [ $# -gt 0 ] && "$@"
  bash $D/run_pair.sh "$name" "$envs" > /work/wt-measure-runs/$name.out 2>&1
  git checkout -q -- .
}
run B-base2 $P ""
run B-4-nocosts $P 4-no-cost-accounting.patch bash $D/4-pre.sh
run B-3-nogroups $P 3-no-xdist-groups.patch
run B-5b-noteardown $P 5b-no-teardown-child.patch
run B-5c-base $P "" bash $D/5c-pre.sh py311-nvrx060-wrapt2 py311-nvrx070-wrapt2
run B-5c-nobytecode $P 5c-no-bytecode-precompile.patch bash $D/5c-pre.sh py311-nvrx060-wrapt2 py311-nvrx070-wrapt2
run B-M-create $M ""
run B-M-base $M ""
run B-5a-nopreload $M 5a-no-framework-preload.patch
run B-2-noforkserver $P 2-no-forkserver.patch
run B-1-nozygote $P 1-no-zygote.patch
run C-N-create $N ""
run C-N-base $N ""
run C-N-3-nogroups $N 3-no-xdist-groups.patch
run C-M-3-nogroups $M 3-no-xdist-groups.patch
run D-M-base $M ""
run D-5a-nopreload $M 5a-no-framework-preload.patch
