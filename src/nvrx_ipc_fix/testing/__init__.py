"""The harness that drives the real NVRx worker for the demo, ``selftest``, the tests and
the benchmarks: ``scenario`` (and its ``scenario_runner``), the CUDA stand-in ``fakecuda`` and
the worker fault injectors ``faults``. Nothing on the activation path imports it."""
