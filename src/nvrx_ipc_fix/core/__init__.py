"""The machinery the fixes share: the one table of targets (``targets``), activation
(``lifecycle``, ``hooks``), settings (``config``), what is installed (``detect``), ``status``,
the wait watch (``monitor``), clean-up and ``release()`` (``cleanup``, ``release``), what runs in
NVRx's worker (``worker``), errors, logging, the Ray hook (``ray``), and what a child of
``os.fork()`` resets (``fork``, ``inherited``). Importing this package
imports none of them."""
