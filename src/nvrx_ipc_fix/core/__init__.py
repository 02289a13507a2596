"""The machinery the fixes share: the one table of targets (``targets``), activation
(``lifecycle``, ``hooks``), settings (``config``), what is installed (``detect``), ``status``,
the wait watch (``monitor``), clean-up and ``release()`` (``cleanup``, ``release``), what runs in
NVRx's worker (``worker``), errors, logging, and the Ray hook (``ray``). Importing this package
imports none of them."""
