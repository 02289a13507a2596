"""The fixes, one module each, named as in ``core.fix_names.FIXES`` (``worker_watch`` holds
``mcore_worker_watch`` too). A fix module holds the wrappers its targets name; it is imported
only when one of them is patched."""
