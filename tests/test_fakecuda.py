"""The CPU stand-in for CUDA IPC (``nvrx_ipc_fix.cli.fakecuda``) behaves as CUDA IPC does
where NVRx can tell: a tensor sent to another process stays where it is (NVRx 0.7.0 compares
data pointers recorded before the send), and its memory is not given to a new tensor while a
process that received it still maps it, however the trainer drops it (torch keeps a CUDA block
sent over IPC until its receiver released it). A plain CPU tensor moves into shared memory at
its first send, and the memory it leaves, or a shared block the trainer drops, can hold the
next tensor born: NVRx 0.7.0 then takes that tensor for the one its worker cached and writes
the old values (seen with two queues and saves in flight, 2 runs in 10)."""

import importlib.util

import pytest

from conftest import expect, needs_nvrx, run_python, scenario

SENT = """
    import gc, json, multiprocessing, os, signal, torch
    from nvrx_ipc_fix.cli import fakecuda

    def receiver(tensors, told, answers):
        held = tensors.get()
        answers.put("mapped")
        told.get()  # the trainer wrote new values
        answers.put([t[0].item() for t in held])
        told.get()
        del held
        gc.collect()
        answers.put("dropped")
        told.get()  # the trainer looked: exit

    def shm_files():
        \"\"\"This process's shared-memory mappings: {(start, end): inode}.\"\"\"
        found = {}
        for line in open("/proc/self/maps"):
            if "/dev/shm/" in line:
                span, _, _, _, inode = line.split(None, 5)[:5]
                start, end = (int(x, 16) for x in span.split("-"))
                found[start, end] = int(inode)
        return found

    def inodes(pointers):
        files = shm_files()
        return {i for p in pointers for (start, end), i in files.items() if start <= p < end}

    def born(count=64):
        \"\"\"The data pointers of ``count`` new stand-in tensors of the sent ones' size.\"\"\"
        return {fakecuda.on_fake_device(torch.zeros(512)).data_ptr() for _ in range(count)}

    def sent_to(how):
        \"\"\"Send 16 tensors to a process started before any of them (it maps only what it
        gets), drop them here, then let that process drop them (``drop``) or kill it.\"\"\"
        context = multiprocessing.get_context("fork")
        tensors, told, answers = context.Queue(), context.Queue(), context.Queue()
        child = context.Process(target=receiver, args=(tensors, told, answers), daemon=True)
        child.start()
        sent = [fakecuda.on_fake_device(torch.full((512,), float(i))) for i in range(16)]
        before = [t.data_ptr() for t in sent]
        tensors.put(sent)
        assert answers.get(timeout=120) == "mapped"
        out = {"moved": [t.data_ptr() for t in sent] != before}
        for i, t in enumerate(sent):
            t.fill_(100 + i)
        told.put("read")
        out["read_there"] = answers.get(timeout=120)
        files = inodes(before)
        del sent, t
        gc.collect()
        out["born_at_a_sent_address"] = len(born() & set(before))
        out["kept"] = len(inodes(before) & files)
        if how == "drop":  # the receiver lives on, without them
            told.put("drop")
            assert answers.get(timeout=120) == "dropped"
        else:
            os.kill(child.pid, signal.SIGKILL)
            child.join(120)
        born(1)  # a birth lets go of what no receiver maps
        out["kept_after"] = len(inodes(before) & files)
        told.put("exit")
        child.join(120)
        return out

    fakecuda.install()
    print(json.dumps({how: sent_to(how) for how in ("drop", "kill")}))
"""


@pytest.mark.once  # the stand-in's own behaviour: the same with any NVRx
@pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="torch is not installed (the nonvrx envs)"
)
def test_a_sent_tensor_stays_put_and_its_memory_is_kept_while_a_receiver_maps_it():
    """16 tensors sent to a process: not moved by the send; the values the trainer writes
    after it are read there; dropped by the trainer, none of their memory is taken by 64 new
    tensors while the receiver holds them, and all of it is let go once the receiver dropped
    them, or died."""
    found = run_python(SENT, timeout=300)
    for how in ("drop", "kill"):
        out = found[how]
        assert out["moved"] is False, found
        assert out["read_there"] == [100.0 + i for i in range(16)], found
        assert out["born_at_a_sent_address"] == 0 and out["kept"] == 16, found
        assert out["kept_after"] == 0, found


@needs_nvrx
@pytest.mark.worker
def test_a_tensor_born_after_the_trainer_dropped_a_cached_one_is_not_taken_for_it():
    """Without the package, the storage replaced twice: the second replace's tensors are born
    while the worker still maps the first storage, which the trainer dropped at the first. On
    a GPU they cannot take its address, so NVRx 0.7.0's pointer check sends them; NVRx 0.6.0
    checks nothing and writes the old values (its stale checkpoints)."""
    report = scenario(["save", "save", "replace", "replace", "save"], fix=False)
    assert report["hang"] is None, report["stderr"]
    assert [s["stale"] for s in report["saves"]] == [0, 0, 8 if expect("stale") else 0]
