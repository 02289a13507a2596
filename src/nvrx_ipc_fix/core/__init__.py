"""The machinery every fix shares, importing nothing above it: the one table of targets
(``targets``, ``fix_names``), activation (``lifecycle``, ``hooks``; ``patching``, wrapping a
target and unwrapping it), settings (``config``), logging and warnings (``log``), the warnings
given for a lost fix or an untested version (``losses``), what is installed (``detect``), what
NVRx's and megatron-core's code looks like (``shapes``, the one adapter), the status
(``status``, its types; ``snapshot``, building it), the trainer-side clean-up (``cleanup``),
errors, a wrapped call's arguments (``arguments``), what a child of ``os.fork()`` resets
(``fork``) and what the packages above register with ``core`` (``state``). Importing this
package imports none of them."""

__version__ = "0.1.0"
