"""Ranks of one gloo job that save as a test says: the rank check's tests
(``tests/test_peers.py``) and the never-worse matrix of ranks
(``tests/test_never_worse_ranks.py``). ``main(spec)`` runs one rank and prints its report as
one JSON line.

``spec``: ``rank``, ``world``, ``dir`` (shared by the ranks), ``steps`` (below), ``timeout``
(seconds for the whole run: past it the rank reports a hang, where its main thread waits,
and ends), ``store`` (``"file"``: the process group meets in a file, a new one at each
``regroup``; ``"tcp"``: one ``TCPStore`` that rank 0 serves, for every group), ``view``
(what the package sees of the default store, ``StoreView``: ``{"fail": n, "delay": s}``,
``{"down": s}``: every call fails for ``s`` seconds from the first, or ``{"gone": true}``: a
torch without ``_get_default_store``), ``stop_on_error`` (the rank stops at the first error,
as a trainer that does not catch it), ``settle`` (``worker.peers.SETTLE_S``), ``persistent``
(False: the trainer's queue is NVRx's process per save) and ``reduce`` (``"async"``: NVRx's
finalize all-reduce returns on the host at once, as NCCL's does: ``HostReturns``).

Steps: ``save`` (planned by every rank of the default group, then a blocking finalize with
``no_dist=False``), ``alone`` (planned in a group of this rank alone, finalized with
``no_dist=True``: a rank-local checkpoint; rank 0 only: NVRx's finalize broadcasts from global
rank ``coordinator_rank``, 0, which fails in a group without it, with or without the
package), ``schedule`` and ``finalize`` (``save`` in two),
``signal-<name>`` and ``wait-<name>`` (a file in ``dir``: ``wait`` until every other rank
made it), ``sleep-<s>``, ``regroup`` (``destroy_process_group`` then a new group on the same
store), ``deactivate`` (the package off from here: this rank runs without it), ``activate``
(on again), ``status``.

The report: every save (``name``: ``save<n>`` or ``alone<n>``, the rank's n-th of the kind;
its ``error`` if one was raised, ``loads``: each of this rank's tensors read back from the
checkpoint holds its value, checked once nothing is pending, and each phase's seconds,
``schedule_s`` and ``finalize_s``), every error (``phase``: ``schedule`` or ``finalize``, its
type, first line, text, ``ranks`` and ``finalized`` where it has them), ``views`` (the store
calls the package made by the end of each step, through ``StoreView``), ``peers``
(``status().peers`` at each ``status``), ``flag_rides`` (at each ``status``: may the failure
flag ride NVRx's all-reduce, ``worker.peers.flag_rides``), and ``hang``.
"""

import json
import os
import sys
import threading
import time
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from harness import gates, stacks
from harness.scenario import Trainer
from nvrx_ipc_fix.cli import fakecuda
from nvrx_ipc_fix.cli.driver import Watchdog, kwargs_accepted

import nvrx_ipc_fix

STATE = "nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver"


class StoreView:
    """What the package sees of the default store (``distributed_c10d._get_default_store``,
    its one way to it): every call counted (``calls``), each made ``delay`` seconds late, and
    the first ``fail`` calls failing as a store does (``DistStoreError``); ``gone``: none
    (a torch without it). The process group itself uses the real store."""

    def __init__(self, fail=0, delay=0.0, gone=False, down=0.0):
        self.fail, self.delay, self.calls = fail, delay, 0
        self.down, self.since = down, None  # every call fails for ``down`` s from the first
        real = distributed_c10d._get_default_store
        if gone:
            del distributed_c10d._get_default_store
        else:
            distributed_c10d._get_default_store = lambda: _Viewed(self, real())


class _Viewed:
    def __init__(self, view, store):
        self.view, self.store = view, store

    def __getattr__(self, name):
        method, view = getattr(self.store, name), self.view

        def call(*args):
            view.calls += 1
            time.sleep(view.delay)
            view.since = time.monotonic() if view.since is None else view.since
            if view.fail > 0 or time.monotonic() - view.since < view.down:
                view.fail -= 1
                raise dist.DistStoreError(f"injected failure of the store's {name}")
            return method(*args)

        return call


class HostReturns:
    """NVRx's finalize all-reduce (``sync_all_async_calls``) returns on the host at once, as
    NCCL's does, before the other ranks entered it: gloo's is started as ``async_op`` and
    waited for at the end (``wait``). Its value read at once is this rank's own."""

    def __init__(self):
        self.works, self.real = [], dist.all_reduce
        dist.all_reduce = self.all_reduce

    def all_reduce(self, tensor, *args, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if not caller.endswith("async_ckpt.core") or kwargs.get("async_op"):
            return self.real(tensor, *args, **kwargs)
        self.works.append(self.real(tensor.clone(), *args, **kwargs, async_op=True))
        return None

    def wait(self):
        for work in self.works:
            work.wait()


@contextmanager
def planned_in(group):
    """NVRx plans the saves scheduled inside in ``group`` (the trainer's own ``save`` plans
    in the default group)."""
    import importlib

    module = importlib.import_module(STATE)
    real = module.save_state_dict_async_plan

    def plan(state_dict, writer, process_group=None, *args, **kwargs):
        return real(state_dict, writer, group, *args, **kwargs)

    module.save_state_dict_async_plan = plan
    try:
        yield
    finally:
        module.save_state_dict_async_plan = real


class Rank:
    def __init__(self, spec):
        self.spec, self.rank, self.world = spec, spec["rank"], spec["world"]
        self.directory, self.inits = spec["dir"], 0
        self.report = {
            "rank": self.rank,
            "saves": [],
            "errors": [],
            "views": [],
            "peers": [],
            "flag_rides": [],
            "hang": None,
            "step": None,
        }
        self.view = None if spec.get("view") is None else StoreView(**spec["view"])
        self.reduce = HostReturns() if spec.get("reduce") == "async" else None
        if "settle" in spec:  # the check's wait between its reads (worker.peers)
            from nvrx_ipc_fix.worker import peers

            peers.SETTLE_S = spec["settle"]
        self.store = self._tcp() if spec.get("store") == "tcp" else None
        self._init()
        self.trainer = Trainer(
            self.directory,
            n_tensors=2,
            numel=512,
            rank=self.rank,
            world_size=self.world,
            starts="forkserver",
        )
        # a rank-local checkpoint has its queue (and worker) of its own, as an EMA's would
        alone = self.trainer.core.AsyncCallsQueue(
            **kwargs_accepted(
                self.trainer.core.AsyncCallsQueue.__init__, persistent=True, cpu_shm_mode=True
            )
        )
        fakecuda.mark_queue(alone)
        self.queues = {"save": self.trainer.queue, "alone": alone}
        if spec.get("persistent") is False:  # NVRx's process per save
            self.trainer.queue.close()
            self.queues["save"] = self.trainer.queue = self.trainer.core.AsyncCallsQueue(
                **kwargs_accepted(self.trainer.core.AsyncCallsQueue.__init__, persistent=False)
            )
            fakecuda.mark_queue(self.trainer.queue)

    def _tcp(self):
        """One ``TCPStore`` for every group: rank 0 serves it on a free port, which the
        others read from a file."""
        path = os.path.join(self.directory, "port")
        if self.rank == 0:
            store = dist.TCPStore(
                "127.0.0.1",
                0,
                self.world,
                True,
                timeout=timedelta(seconds=60),
                wait_for_workers=False,
            )
            with open(path + ".tmp", "w") as out:
                out.write(str(store.port))
            os.replace(path + ".tmp", path)
            return store
        gates.wait_for(path)
        with open(path) as port:
            return dist.TCPStore(
                "127.0.0.1", int(port.read()), self.world, False, timeout=timedelta(seconds=60)
            )

    def _init(self):
        self.inits += 1
        if self.store is not None:
            dist.init_process_group("gloo", store=self.store, rank=self.rank, world_size=self.world)
        else:
            dist.init_process_group(
                "gloo",
                rank=self.rank,
                world_size=self.world,
                init_method=f"file://{self.directory}/pg{self.inits}",
            )
        # every rank makes every group (torch's rule); this rank saves alone in its own
        self.own = [dist.new_group([r]) for r in range(self.world)][self.rank]

    def regroup(self):
        """A new default group on the same store. gloo's rendezvous keys of the last group
        are still there (each rank's address), and a rank that read the other's old one
        would not connect: each rank takes its own away first, once every rank's group is
        down (torch 2.13's key of that address: the group's name, ``cpu``, gloo's ``0``)."""
        dist.destroy_process_group()
        if self.store is not None:
            self._meet(f"down{self.inits}")
            self.store.delete_key(f"0//cpu//0/{self.rank}")
            self._meet(f"clean{self.inits}")
        self._init()

    def _meet(self, name):
        key = f"test/{name}"
        self.store.add(key, 1)
        while int(self.store.add(key, 0)) < self.world:
            time.sleep(0.01)

    def run(self):
        finished = threading.Event()
        threading.Thread(target=self._watch, args=(finished,), daemon=True).start()
        for index, step in enumerate(self.spec["steps"]):
            self.report["step"] = index
            stopped = self._step(step)
            self.report["views"].append(None if self.view is None else self.view.calls)
            if stopped:
                break
        self.report["step"] = None
        finished.set()
        if self.reduce is not None:
            self.reduce.wait()
        for queue in self.queues.values():
            queue.close()
        dist.destroy_process_group()
        return self.report

    def _watch(self, finished):
        if not finished.wait(self.spec["timeout"]):
            self.report["hang"] = {"step": self.report["step"], "waits_in": stacks.main()}
            print(json.dumps(self.report), flush=True)
            Watchdog.exit()

    def _step(self, step):
        """One step; True where the rank stops here."""
        trainer, alone = self.trainer, step == "alone"
        if step in ("save", "alone", "schedule"):
            # every rank's n-th save of every rank is the same checkpoint (its version n); a
            # save of this rank alone has a directory of its own
            kind = "alone" if alone else "save"
            n = 1 + sum(saved["name"].startswith(kind) for saved in self.report["saves"])
            trainer.version = n - 1 + 100 * alone
            trainer.directory = os.path.join(self.directory, f"rank{self.rank}" * alone)
            saved = {
                "name": f"{kind}{n}",
                "version": trainer.version + 1,
                "error": None,
                "loads": None,
                "no_dist": alone,
                "scheduled": False,
                "path": os.path.join(trainer.directory, f"ckpt{trainer.version + 1}"),
            }
            self.report["saves"].append(saved)
            if not self._call(saved, "schedule", self._schedule, saved, alone):
                return bool(self.spec.get("stop_on_error"))
            if step == "schedule":
                return False
        if step in ("save", "alone", "finalize"):
            saved = self.report["saves"][-1]
            trainer.no_dist = saved["no_dist"]
            trainer.queue = self.queues["alone" if saved["no_dist"] else "save"]
            self._call(saved, "finalize", trainer.finalize)
            self._loads()
            return bool(saved["error"] and self.spec.get("stop_on_error"))
        if step.startswith("signal-"):
            gates.open_gate(os.path.join(self.directory, f"{step[7:]}.{self.rank}"))
        elif step.startswith("wait-"):
            for other in set(range(self.world)) - {self.rank}:
                gates.wait_for(
                    os.path.join(self.directory, f"{step[5:]}.{other}"), self.spec["timeout"]
                )
        elif step.startswith("sleep-"):
            time.sleep(float(step[6:]))
        elif step == "regroup":
            self.regroup()
        elif step == "deactivate":
            nvrx_ipc_fix.deactivate()
        elif step == "activate":
            nvrx_ipc_fix.activate()
        elif step == "status":
            self.report["peers"].append(getattr(nvrx_ipc_fix.status(), "peers", None))
            peers = sys.modules.get("nvrx_ipc_fix.worker.peers")
            rides = getattr(peers, "flag_rides", None)  # the check before had none
            self.report["flag_rides"].append(None if rides is None else rides())
        else:
            raise ValueError(f"unknown step {step!r}")
        return False

    def _schedule(self, saved, alone):
        trainer = self.trainer
        trainer.queue = self.queues["alone" if alone else "save"]
        if alone:
            with planned_in(self.own):
                trainer.save(wait=False)
        else:
            trainer.save(wait=False)
        saved["scheduled"] = True

    def _call(self, saved, phase, function, *args):
        """``function(*args)``; an exception it raised is recorded (False returned)."""
        start = time.monotonic()
        try:
            function(*args)
            return True
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 the verdict: recorded (torch's
            # CheckpointException is a BaseException)
            error = {
                "phase": phase,
                "type": type(exc).__name__,
                "message": str(exc).splitlines()[0][:400],
                "text": str(exc)[-2000:],
                "ranks": list(getattr(exc, "ranks", ()) or ()),
                "finalized": list(getattr(exc, "finalized", ()) or ()),
            }
            saved["error"] = saved["error"] or error
            self.report["errors"].append(dict(error, save=saved["name"]))
            return False
        finally:
            saved[f"{phase}_s"] = round(time.monotonic() - start, 3)

    def _loads(self):
        """Each save scheduled and finalized, not yet read back: do its tensors load?"""
        trainer = self.trainer
        if any(queue.get_num_unfinalized_calls() for queue in self.queues.values()):
            return
        for saved in self.report["saves"]:
            if saved["loads"] is None and saved["scheduled"]:
                try:
                    saved["loads"] = trainer.stale_tensors(saved["path"], saved["version"]) == 0
                except (KeyboardInterrupt, SystemExit):
                    raise
                except BaseException as exc:  # noqa: BLE001 unloadable: not saved
                    saved["loads"] = f"{type(exc).__name__}: {exc}"[:300]


def main(spec):
    torch.manual_seed(0)
    report = Rank(spec).run()
    print(json.dumps(report), flush=True)
    return 0
