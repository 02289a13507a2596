"""The package's forkservers are its own: the standby (``worker.standby``) and any
other server of the package is a private ``multiprocessing.forkserver.ForkServer``, never
multiprocessing's process-wide one, so a child the user's own code starts with
``get_context("forkserver")`` (and, where forkserver is the default start method, as on
Python 3.14, every default child) comes from the user's server, with the environment as it is
now and none of the package's preloads. No NVRx needed: this runs on every Python of the
matrix (the standby serving NVRx's worker: ``test_standby.py``)."""

from conftest import run_python

LATE = "set after the standby started"


def test_the_standby_leaves_the_user_s_forkserver_and_default_context_alone():
    """What a ``restart`` release starts (``standby.start()``), then the user's children.
    Without NVRx the standby's probe finds torch and NVRx missing; it is started all the same,
    as where NVRx is installed (before: it was multiprocessing's forkserver, so the user's
    forkserver child came from it, with the package imported and the old environment)."""
    seen = run_python(
        f"""
        import json, multiprocessing, os, threading
        from multiprocessing import forkserver
        from nvrx_ipc_fix.worker import standby
        from harness.user_child import start

        standby.start()  # what a restart release does
        started = getattr(standby._standby, "pid", None)
        for thread in threading.enumerate():
            if thread.name == "nvrx_ipc_fix-standby":
                thread.join(150)  # its probe, whatever it finds
        # as any start of a process (NVRx's spawn too), it may fix an unset start method, but
        # only to Python's default, the first of get_all_start_methods()
        kept = multiprocessing.get_start_method() == multiprocessing.get_all_start_methods()[0]
        os.environ["LATE"] = {LATE!r}
        print(json.dumps({{"standby": started, "method_kept": kept,
                          "forkserver": start(multiprocessing.get_context("forkserver"), "LATE"),
                          "default": start(multiprocessing.get_context(), "LATE"),
                          "preload": forkserver._forkserver._preload_modules}}))
    """,
        timeout=200,
    )
    assert seen["standby"] is not None and seen["method_kept"], seen
    child = seen["forkserver"]
    assert child["answered"] and child["exitcode"] == 0, child
    assert child["variable"] == LATE and child["imported"] == [], child
    assert child["parent"] != seen["standby"], child
    assert seen["preload"] == ["__main__"]  # multiprocessing's own, as Python sets it
    default = seen["default"]
    assert default["answered"] and default["variable"] == LATE, default
    if default["method"] == "forkserver":  # Python 3.14+ on Linux
        assert default["imported"] == [] and default["parent"] != seen["standby"], default


def test_a_private_forkserver_serves_its_children_and_leaves_multiprocessing_s_alone():
    """``worker.private_forkserver.Context`` on this Python: its children come from its own
    server, with its preloads and the environment the server started with; a pipe reaches
    them (descriptors pass as to any forkserver's child); multiprocessing's server is not
    started, and the user's, started after, is another process."""
    seen = run_python("""
        import json, multiprocessing, os
        from multiprocessing import forkserver
        from nvrx_ipc_fix.worker.private_forkserver import Context
        from harness.user_child import start

        os.environ["WHEN"] = "before the server started"
        private = Context(["colorsys"])
        ours = start(private, "WHEN", watched=["colorsys"])
        os.environ["WHEN"] = "after"
        again = start(private, "WHEN", watched=["colorsys"])
        untouched = forkserver._forkserver._forkserver_pid is None
        user = start(multiprocessing.get_context("forkserver"), "WHEN", watched=["colorsys"])
        print(json.dumps({"server": private.pid, "ours": ours, "again": again,
                          "untouched": untouched, "user": user}))
    """)
    server = seen["server"]
    for child in (seen["ours"], seen["again"]):
        assert child["answered"] and child["exitcode"] == 0, child
        assert child["parent"] == server and child["imported"] == ["colorsys"], child
        assert child["variable"] == "before the server started", child
    assert seen["untouched"]
    user = seen["user"]
    assert user["answered"] and user["exitcode"] == 0, user
    assert user["parent"] != server and user["imported"] == [], user
    assert user["variable"] == "after", user
