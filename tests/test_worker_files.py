"""The files a checkpoint worker leaves the trainer (its traceback, its pinning report) are in a
directory of the trainer's own, never under a name another user of the machine could plant in
the shared temporary directory (``worker.inside``). Each worker fault test reads a traceback
left this way through NVRx's real worker (``test_faults.py``); here the trainer and the worker
are one process, so that the planted names are known."""

import os

from conftest import needs_nvrx, run_python

#: In one process, as trainer then as worker: a symbolic link planted where the worker's
#: traceback used to go (the shared temporary directory, a name made of the uid and the pid),
#: pointing at a file of the user's; a save request whose ``preload_fn`` raises, as the worker
#: watch sends it; the worker runs it; the trainer reads the traceback. Then a directory name
#: that is a symbolic link (as one planted where the trainer's directory was once removed).
PLANTED = """
    import json, os, stat, tempfile
    from nvidia_resiliency_ext.checkpointing.async_ckpt import core
    from nvrx_ipc_fix.fixes import worker_watch
    from nvrx_ipc_fix.worker import inside

    victim = os.path.join(tempfile.mkdtemp(), "precious")
    with open(victim, "w") as out:
        out.write("the user's own file")
    planted = os.path.join(tempfile.gettempdir(),
                           f"nvrx_ipc_fix-{os.getuid()}-worker-{os.getpid()}.traceback")
    os.symlink(victim, planted)

    def fails():
        raise RuntimeError("injected in the worker")

    request = worker_watch._reporting(core.AsyncRequest(fails, (), [], preload_fn=fails))
    try:
        request.preload_fn()
    except RuntimeError:
        pass
    traceback = inside.read_traceback(os.getpid())
    directory = inside.directory()
    mode = stat.S_IMODE(os.lstat(directory).st_mode)

    elsewhere = tempfile.mkdtemp()
    link = os.path.join(tempfile.gettempdir(), "a-directory-planted-as-a-link")
    os.symlink(elsewhere, link)
    inside._told(link)
    try:
        raise RuntimeError("again")
    except RuntimeError:
        inside.leave_traceback()
    print(json.dumps({"victim": open(victim).read(), "traceback": traceback,
                      "directory": directory, "mode": mode, "in_tmp": tempfile.gettempdir(),
                      "through_link": os.listdir(elsewhere)}))
"""


@needs_nvrx
def test_the_worker_s_files_are_in_a_private_directory_and_a_planted_link_is_not_followed():
    seen = run_python(PLANTED)
    assert seen["victim"] == "the user's own file", seen  # the link was not followed
    assert "RuntimeError: injected in the worker" in (seen["traceback"] or ""), seen
    assert seen["mode"] == 0o700 and os.path.dirname(seen["directory"]) == seen["in_tmp"]
    assert seen["through_link"] == [], seen  # nothing written through a linked directory
    assert not os.path.exists(seen["directory"]), seen  # removed when the trainer exited
