#!/usr/bin/env bash
# Before each run of the 5c pair (baseline and patched): the envs' site-packages without
# bytecode, as uv leaves them on a clean clone (tox-uv writes none).
# usage: 5c-pre.sh ENV [ENV...]
cd /work/wt-measure && for env in "$@"; do
  find .tox/$env/lib/python3.*/site-packages -name __pycache__ -type d -prune -exec rm -rf {} +
  echo "$env: $(find .tox/$env/lib/python3.*/site-packages -name '*.pyc' | wc -l) .pyc left"
done
