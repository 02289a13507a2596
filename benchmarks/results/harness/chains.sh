#!/usr/bin/env bash
# The whole measurement, one run after another (each: apply, run the pair as CI does, revert).
set -u
P=py311-nvrx060-wrapt2,py311-nvrx070-wrapt2
M=py311-megatron-nvrx060-wrapt2,py311-bridge-nvrx060-wrapt2
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
echo done > /work/wt-measure-runs/CHAIN-DONE
#!/usr/bin/env bash
# After chain.sh: the xdist groups where session fixtures are shared (install venvs, Ray's venv,
# SkyRL's and Bridge's runs).
set -u
while [ ! -e /work/wt-measure-runs/CHAIN-DONE ]; do sleep 10; done
N=py311-nonvrx-wrapt2,py311-ray-wrapt2
M=py311-megatron-nvrx060-wrapt2,py311-bridge-nvrx060-wrapt2
D=/work/wt-measure-patches
cd /work/wt-measure
run() {
  local name=$1 envs=$2 patch=${3:-}
  [ -n "$patch" ] && git apply "$D/$patch"
  bash $D/run_pair.sh "$name" "$envs" > /work/wt-measure-runs/$name.out 2>&1
  git checkout -q -- .
}
run C-N-create $N ""
run C-N-base $N ""
run C-N-3-nogroups $N 3-no-xdist-groups.patch
run C-M-3-nogroups $M 3-no-xdist-groups.patch
echo done > /work/wt-measure-runs/CHAIN2-DONE
#!/usr/bin/env bash
# After chain2.sh: megatron and bridge again, base then without the framework preload (the
# first pair shared the CPUs with another test run).
set -u
while [ ! -e /work/wt-measure-runs/CHAIN2-DONE ]; do sleep 10; done
M=py311-megatron-nvrx060-wrapt2,py311-bridge-nvrx060-wrapt2
D=/work/wt-measure-patches
cd /work/wt-measure
run() {
  local name=$1 envs=$2 patch=${3:-}
  [ -n "$patch" ] && git apply "$D/$patch"
  bash $D/run_pair.sh "$name" "$envs" > /work/wt-measure-runs/$name.out 2>&1
  git checkout -q -- .
}
run D-M-base $M ""
run D-5a-nopreload $M 5a-no-framework-preload.patch
echo done > /work/wt-measure-runs/CHAIN3-DONE
