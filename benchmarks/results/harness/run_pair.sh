#!/usr/bin/env bash
# usage: run_pair.sh NAME ENV1,ENV2  -- runs the envs as CI does (scripts/test's run-parallel,
# two at a time) in /work/wt-measure, with the patch as it stands, logging to
# /work/wt-measure-runs/NAME.log
set -u
name=$1; envs=$2
log=/work/wt-measure-runs/$name.log
cd /work/wt-measure
{
  echo "# $name  envs=$envs"
  echo "# date: $(date -Is)  commit: $(git rev-parse --short HEAD)  diff: $(git diff --stat | tail -1)"
  echo "# uptime before: $(uptime)"
  /usr/bin/time -f "# time: wall %e s, user %U s, sys %S s (tox's process tree)" \
    scripts/test run-parallel --parallel 2 --parallel-no-spinner -e "$envs"
  echo "# rc: $?"
  echo "# uptime after: $(uptime)"
} > "$log" 2>&1
grep -E "^# |ended after|OK \(|FAIL|tests: |all [0-9]+ tests" "$log"
