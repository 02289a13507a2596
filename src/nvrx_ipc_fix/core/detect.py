"""What NVRx is installed, which cache features it has, and whether it is newer than tested.

Features decide, the version only helps: NVRx git builds report ``X.Y.Z.devN+hash``
and ``__version__`` exists only from 0.5.0. Nothing here imports NVRx; a class is
probed only once its module is in ``sys.modules``.
"""

import sys  # no `from __future__ import annotations`: the .pth path would import __future__

NVRX_DIST = "nvidia-resiliency-ext"
MCORE_DIST = "megatron-core"
CORE = "nvidia_resiliency_ext.checkpointing.async_ckpt.core"
FS = "nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async"
MCORE_ASYNC = "megatron.core.dist_checkpointing.strategies.async_utils"
MCORE_FS = "megatron.core.dist_checkpointing.strategies.filesystem_async"
MEGATRON = "megatron.training.async_utils"
BRIDGE = "megatron.bridge.training.checkpointing"
NEMO_POLICY = "nemo_rl.models.policy.workers.megatron_policy_worker"
NEMO_VALUE = "nemo_rl.models.value.workers.megatron_value_worker"
SLIME_ACTOR = "slime.backends.megatron_utils.actor"
#: Every module a target of the table (``targets.TARGETS``) patches: what the warnings held
#: back about settings wait for (a test checks it against the table).
MODULES = (CORE, FS, MCORE_ASYNC, MCORE_FS, MEGATRON, BRIDGE, NEMO_POLICY, NEMO_VALUE, SLIME_ACTOR)
#: First release with the IPC tensor cache.
FIRST_CACHING_RELEASE = (0, 6, 0)
#: What each tested release of NVRx has that the fixes need, read from its code once, here
#: (docs/versions.md): ``cache``, the IPC tensor cache (``_cached_identifiers``);
#: ``upstream_ptrs``, its writer re-sends what moved (PR #314); ``snapshots``, its writer
#: copies every CPU tensor of a save (PR #376); ``worker_loop``, its worker calls
#: ``async_process_target`` by name; ``warmup``, ``AsyncCallsQueue.warmup_persistent_caller``;
#: ``sigterm_timeout``, its caller takes one (``close(abort=True)`` SIGTERMs the worker and
#: waits); ``wrap_exception``, what ``retrieve_write_results`` wraps a failure with for the
#: finalize's gather (None: it raises). Its caller keeps its worker's queues on itself, made
#: in ``__init__``. Another version (a git build, a newer release) is read by the names its
#: classes have (``shapes``). tests/conftest.py's ``EXPECT`` is built from this table.
NVRX_RELEASES: dict[str, dict[str, object]] = {
    "0.4.1": dict(
        cache=False,
        upstream_ptrs=False,
        snapshots=False,
        worker_loop=False,
        warmup=False,
        sigterm_timeout=False,
        wrap_exception=None,
    ),
    "0.5.0": dict(
        cache=False,
        upstream_ptrs=False,
        snapshots=False,
        worker_loop=True,
        warmup=False,
        sigterm_timeout=False,
        wrap_exception="_wrap_exception",
    ),
    "0.6.0": dict(
        cache=True,
        upstream_ptrs=False,
        snapshots=False,
        worker_loop=True,
        warmup=True,
        sigterm_timeout=True,
        wrap_exception="_wrap_exception",
    ),
    "0.7.0": dict(
        cache=True,
        upstream_ptrs=True,
        snapshots=True,
        worker_loop=True,
        warmup=True,
        sigterm_timeout=True,
        wrap_exception="_wrap_exception_for_gather",
    ),
}
#: megatron-core's copy of NVRx's async code, in the release read (the megatron tox env): its
#: writer sends the trainer's own CPU tensors; its caller keeps its worker and queues on its
#: class and takes no ``sigterm_timeout``.
MCORE_RELEASES: dict[str, dict[str, object]] = {
    "0.17.1": dict(snapshots=False, sigterm_timeout=False)
}
RELEASES = {NVRX_DIST: NVRX_RELEASES, MCORE_DIST: MCORE_RELEASES}
#: The newest release of each distribution the package was tested with (the tox matrix and
#: the GPU runs). A newer one is "untested": the fixes still apply where their probes pass.
TESTED = {NVRX_DIST: "0.7.0", MCORE_DIST: "0.19.2"}
#: Which distribution ships the target modules that start so. A target whose distribution is
#: not installed is ``not_applicable`` until its module is imported all the same (a checkout
#: on ``PYTHONPATH``). NeMo RL and slime, often run from a checkout, are not named: their
#: targets stay ``pending``.
_SHIPPED_BY = (
    ("nvidia_resiliency_ext.", NVRX_DIST),
    ("megatron.bridge.", "megatron-bridge"),
    ("megatron.core.", MCORE_DIST),
    ("megatron.training.", MCORE_DIST),
)


def distribution_version(name: str) -> str | None:
    """The installed version of distribution ``name``, or ``None`` if it is not installed."""
    from importlib import metadata  # deferred: costs more than the rest of the package

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
    except (ImportError, OSError, ValueError, TypeError):  # a broken dist-info: unknown
        return "unknown"


def writer_class():
    """NVRx's ``FileSystemWriterAsync`` if its module is imported, else ``None``."""
    module = sys.modules.get(FS)
    return getattr(module, "FileSystemWriterAsync", None)


def caller_class():
    """NVRx's ``PersistentAsyncCaller`` if its module is imported, else ``None``."""
    module = sys.modules.get(CORE)
    return getattr(module, "PersistentAsyncCaller", None)


def features() -> dict[str, str]:
    """Probe the imported NVRx classes; each value is ``yes``, ``no``, a type name or
    ``not imported``."""
    found: dict[str, str] = {}
    caller = caller_class()
    if caller is None:
        found["PersistentAsyncCaller._worker_data_cache"] = "not imported"
    else:
        found["PersistentAsyncCaller._worker_data_cache"] = _yes(
            hasattr(caller, "_worker_data_cache")
        )
    writer = writer_class()
    names = ("_cached_identifiers", "cleanup_tensor_caches", "_cached_tensor_data_ptrs")
    for name in names:
        key = f"FileSystemWriterAsync.{name}"
        if writer is None:
            found[key] = "not imported"
        elif name == "_cached_identifiers" and hasattr(writer, name):
            found[key] = type(getattr(writer, name)).__name__
        else:
            found[key] = _yes(hasattr(writer, name))
    return found


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def may_cache(version: str | None) -> bool:
    """Is an NVRx of ``version`` installed that has, or may have, the IPC cache (the fixes
    and the automatic release apply)?"""
    return version is not None and release_has_cache(version) is not False


def release_has_cache(version: str | None) -> bool | None:
    """``False`` for a release older than 0.6.0, ``True`` for 0.6.0 or newer, ``None`` if unknown.

    Dev and local builds (``0.5.0.dev94+g1ae74b7``) return ``None``: git main had the
    cache before 0.6.0 was tagged, so only a probe of the classes can tell.
    """
    if version in NVRX_RELEASES:
        return bool(NVRX_RELEASES[version]["cache"])
    if not version or version == "unknown":
        return None
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:
        return None
    try:
        parsed = Version(version)
    except InvalidVersion:
        return None
    if parsed.is_devrelease or parsed.local or parsed.is_prerelease:
        return None
    return parsed.release[:3] >= FIRST_CACHING_RELEASE


def distribution_of(module_name: str) -> str | None:
    """The distribution that ships target module ``module_name``, or ``None``."""
    return next((dist for prefix, dist in _SHIPPED_BY if module_name.startswith(prefix)), None)


def shipped_by(module_name: str) -> str | None:
    """The distribution in ``TESTED`` that ships module ``module_name``, or ``None``."""
    dist = distribution_of(module_name)
    return dist if dist in TESTED else None


def untested(dist: str, version: str | None) -> bool:
    """Is ``version`` of ``dist`` newer than ``TESTED[dist]``? Release numbers are compared,
    so a dev or pre build of a newer release counts as newer and ``0.7.0.post1`` does not.
    A version that cannot be parsed (``unknown``: a broken dist-info) counts as untested:
    nothing says it is one that was tested. ``False`` when ``dist`` is not installed."""
    if version is None:
        return False
    try:
        from packaging.version import Version

        found, newest = Version(version), Version(TESTED[dist])
    except (ImportError, ValueError):  # InvalidVersion; packaging missing
        return True
    width = max(len(found.release), len(newest.release))

    def key(v):  # 0.7 == 0.7.0
        return v.epoch, v.release + (0,) * (width - len(v.release))

    return key(found) > key(newest)


def untested_versions() -> dict[str, str]:
    """Each installed distribution of ``TESTED`` that is newer than tested -> its version."""
    found = {dist: distribution_version(dist) for dist in TESTED}
    return {
        dist: version
        for dist, version in found.items()
        if version is not None and untested(dist, version)
    }
