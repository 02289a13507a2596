#!/usr/bin/env bash
# Before a run with 4-no-cost-accounting.patch: remove the start-up hook that an earlier
# run's commands_pre installed into each env (tests/costs.py install), so that no process
# of the run imports it. A later baseline run installs it again.
cd /work/wt-measure && rm -fv .tox/*/lib/python3.*/site-packages/_nvrx_ipc_fix_test_costs.p*
