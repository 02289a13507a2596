"""The machinery the fixes share, importing nothing above it: the one table of targets
(``targets``), activation (``lifecycle``, ``hooks``), settings (``config``), what is installed
(``detect``), what NVRx's and megatron-core's code looks like (``shapes``, the one adapter),
``status``, the wait watch (``monitor``), the watch's record of NVRx's callers and workers
(``workers``), clean-up, release and prewarm (``cleanup``, ``release``,
``prewarming``), what runs in NVRx's worker (``worker``), errors, logging,
and what a child of ``os.fork()`` resets (``fork``, ``inherited``). Importing this
package imports none of them."""

__version__ = "0.1.0"
