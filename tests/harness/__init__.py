"""The tests' harness, built on the driver the package ships for its demo
(``nvrx_ipc_fix.cli.driver``): ``scenario`` (the driver's trainer as one rank of several, on
NVRx's or megatron-core's queue, with worker faults, NVRx's workers from a forkserver and the
tests' steps), ``faults`` (what a failing worker does, run inside it),
``gates`` (files that order the writes of saves in flight),
``fakedriver`` (a CPU stand-in for the CUDA driver's process checkpoint API), ``stacks``
(where a hung process waits), ``user_child`` (a child the user's own code starts),
``races`` (races driven in the trainer) and ``ranks`` (gloo ranks that save as a test says,
with a view of the store the package uses). On the
path of every child the tests start (``conftest._env``)."""
