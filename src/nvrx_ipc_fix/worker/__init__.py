"""The checkpoint worker's life, from its start to its release: what the package knows of
NVRx's callers and workers (``registry``), the watch of their waits (``monitor``), what runs
inside the worker (``inside``), starting it ahead (``prewarm``, from the ``standby``, a
``private_forkserver``, checked by ``standby_probe``), keeping it with nothing on the device
(``suspend``, ``cuda_checkpoint``), releasing what it maps (``release``: ``release()``,
``offloading()`` and the automatic release), and detaching a child of ``os.fork()`` from
its parent's workers (``inherited``). Imports only ``core``; importing this package imports none
of them."""
