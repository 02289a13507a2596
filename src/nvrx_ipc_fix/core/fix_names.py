"""The fixes, by the names ``NVRX_IPC_FIX_DISABLE`` and ``status()`` use, each with what it
does in one line. The target table (``targets``) gives each its targets. Imports nothing."""

#: Fix name -> what it does, in one line.
FIXES = {
    "clear_on_close": "clear the trainer-side cache when the checkpoint worker is closed "
    "(no 'Worker cache miss' hang on the next save)",
    "stale_guard": "re-send tensors whose storage moved (no stale checkpoints on NVRx 0.6.0)",
    "cpu_snapshot": "the worker writes each CPU tensor of a save as it was at the schedule (NVRx "
    "before 0.7.0 sends the trainer's own: a step right after the schedule "
    "went into the checkpoint)",
    "own_results": "each save's write results reach its own finalize (NVRx shares one "
    "results queue per process: saves in flight at once took each other's)",
    "release_on_offload": "release the worker's CUDA IPC mappings before NeMo RL or slime "
    "moves model or optimizer storage, and with the restart strategy "
    "start the next worker when the model is back (NVRX_IPC_FIX_RELEASE)",
    "worker_watch": "a dead NVRx checkpoint worker becomes a CheckpointWorkerError on every "
    "rank, a stuck one an ERROR log line (NVRX_IPC_FIX_STALL_TIMEOUT)",
    "mcore_worker_watch": "the same for megatron-core's own persistent checkpoint worker "
    "(async_strategy='mcore')",
    "prewarm": "start the NVRx checkpoint worker ahead of the save that needs it (prewarm(), "
    "strategy restart, NVRX_IPC_FIX_PREWARM=start); the save waits until it is ready",
    "suspend": "a worker the suspend strategy keeps with nothing on the device is resumed "
    "before it is given a save or closed (without it, the release restarts instead)",
}
