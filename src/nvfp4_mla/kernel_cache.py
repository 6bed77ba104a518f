"""The cache of compiled kernels: trusted layers on disk, one compile per key, loaded kernels.

It only runs what it built for that key (docs/format.md section 11): the directory and the file
must be owned by this user or root and writable by nobody else, and the cubin must carry its own
full key, compiled into it as a string constant. Anything else is a miss with a warning, never a
crash. Calls after the first do one dict lookup.
"""

from __future__ import annotations

import os
import stat
import tempfile
import threading
import time
import warnings
from pathlib import Path

from . import config, jit
from .device import device_info
from .launch import Launcher

STALE_TEMP_SECONDS = 3600  # a temp file this old was left by a killed process


class CacheError(RuntimeError):
    """A directory asked for explicitly cannot hold kernels (unwritable or untrusted)."""


def distrust(st: os.stat_result, what: str) -> str | None:
    """Why a file or directory with status ``st`` may not be trusted, or None (ssh StrictModes:
    owned by this user or root, writable by nobody else; group opt-in widens that)."""
    trust_group = config.trust_group()
    writable_by_others = stat.S_IWOTH | (0 if trust_group else stat.S_IWGRP)
    if st.st_mode & writable_by_others:
        return f"{what} is writable by {'others' if st.st_mode & stat.S_IWOTH else 'its group'}"
    if not trust_group and st.st_uid not in (os.geteuid(), 0):
        return f"{what} is owned by uid {st.st_uid}, not by this user or root"
    return None


class KernelCache:
    """Compiled kernels on disk (layered, trusted, locked) and loaded per device.

    ``layers`` are searched in order for a hit; a miss compiles into the first writable, trusted
    layer (or, when there is none, is kept in memory only). ``KernelCache()`` reads the layers from
    the environment (:func:`nvfp4_mla.config.cache_dirs`).
    """

    def __init__(self, layers: list[Path] | None = None):
        self.layers = config.cache_dirs() if layers is None else [Path(p) for p in layers]
        self._lock = threading.RLock()  # compiles, disk writes and module loads of this process
        self._launchers: dict[tuple, Launcher] = {}
        self._warned: set[str] = set()
        self._writable: Path | bool | None = False  # False: not looked for yet

    # ------------------------------------------------------------ layers

    def _warn(self, message: str) -> None:
        config.log.warning(message)
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(f"nvfp4_mla: {message}", RuntimeWarning, stacklevel=4)

    def _trusted_dir(self, directory: Path) -> bool:
        try:
            st = os.stat(directory)
        except OSError:
            return False
        reason = "not a directory" if not stat.S_ISDIR(st.st_mode) else distrust(st, f"directory {directory}")
        if reason:
            self._warn(f"kernel cache {directory} ignored: {reason}")
        return reason is None

    def prepare(self, directory: Path) -> str | None:
        """Makes ``directory`` ready to receive kernels; returns why it cannot, or None.

        A directory this creates is private (0700)."""
        try:
            if not directory.exists():
                directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = os.stat(directory)
        except OSError as exc:
            return f"cannot create {directory}: {exc.strerror or exc}"
        if not stat.S_ISDIR(st.st_mode):
            return f"{directory} is not a directory"
        reason = distrust(st, f"directory {directory}")
        if reason:
            return reason
        if not os.access(directory, os.W_OK | os.X_OK):
            return f"{directory} is not writable by this user"
        return None

    def writable_dir(self) -> Path | None:
        """The layer misses compile into, or None (memory only)."""
        if self._writable is False:
            reasons = []
            for directory in self.layers:
                reason = self.prepare(directory)
                if reason is None:
                    self._writable = directory
                    break
                reasons.append(reason)
            else:
                self._writable = None
                self._warn(f"no writable kernel cache directory ({'; '.join(reasons)}): kernels are compiled in memory")
        return self._writable if isinstance(self._writable, Path) else None

    # ------------------------------------------------------------ files

    @staticmethod
    def file_name(key: str, arch: str) -> str:
        return f"{arch}-{key[:32]}.cubin"

    def read_verified(self, path: Path, key: str) -> bytes | None:
        """The cubin at ``path`` if it is trusted and proves it is ``key``'s kernel, else None
        (with a warning when a file is there but refused). Any fault is a miss."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._warn(f"kernel cache file {path} refused: {exc.strerror or exc}")
            return None
        try:
            st = os.fstat(fd)
            reason = "not a regular file" if not stat.S_ISREG(st.st_mode) else distrust(st, "the file")
            if reason is None:
                with os.fdopen(os.dup(fd), "rb") as f:
                    data = f.read()
                if jit.proof(key) not in data:
                    reason = "it is not this key's kernel (truncated, corrupted or another kernel)"
        except OSError as exc:
            reason = str(exc.strerror or exc)
        finally:
            os.close(fd)
        if reason is not None:
            self._warn(f"kernel cache file {path} refused: {reason}; compiling")
            return None
        return data

    def lookup(self, key: str, arch: str) -> tuple[bytes, Path] | None:
        name = self.file_name(key, arch)
        for directory in self.layers:
            if (directory / name).exists() or (directory / name).is_symlink():
                if not self._trusted_dir(directory):
                    continue
                data = self.read_verified(directory / name, key)
                if data is not None:
                    config.log.debug("kernel %s found in %s", name, directory)
                    return data, directory / name
        return None

    @staticmethod
    def publish(directory: Path, name: str, data: bytes) -> Path:
        """Writes ``data`` as ``directory/name`` atomically (temp file, fsync, rename) and removes
        temp files that killed processes left behind."""
        now = time.time()
        for stale in directory.glob("*.tmp"):
            try:
                if now - stale.lstat().st_mtime > STALE_TEMP_SECONDS:
                    stale.unlink()
            except OSError:
                pass
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)  # readable by the users a shared precompiled set serves
            os.replace(tmp, directory / name)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return directory / name

    def build(self, spec: jit.KernelSpec, arch: str, directory: Path | None = None) -> tuple[bytes, Path | None]:
        """The verified cubin of ``spec`` for a GPU of ``arch`` (built for
        :func:`jit.target_arch`, e.g. sm_90a) and where it lies (None: memory only), compiling on a
        miss. With ``directory``, it compiles into exactly that directory (or raises
        :class:`CacheError`). One compile per key across threads and processes."""
        arch = jit.target_arch(spec, jit.check_arch(arch))
        key = jit.kernel_key(spec, arch)
        name = self.file_name(key, arch)
        with self._lock:
            if directory is None:
                found = self.lookup(key, arch)
                if found is not None:
                    return found
                target = self.writable_dir()
            else:
                reason = self.prepare(directory)
                if reason is not None:
                    raise CacheError(f"cannot write kernels into {directory}: {reason}")
                target = directory
            if target is None:
                return self._compile(spec, arch, key), None
            from filelock import FileLock

            data = None
            try:
                with FileLock(str(target / f"{name}.lock")):
                    data = self.read_verified(target / name, key)  # another process may have built it
                    if data is None:
                        data = self._compile(spec, arch, key)
                        self.publish(target, name, data)
            except OSError as exc:  # the directory changed under us (removed, made read-only, ...)
                if directory is not None:
                    raise CacheError(f"cannot write kernels into {directory}: {exc}") from exc
                self._warn(f"kernel cache {target} failed ({exc}); this kernel is kept in memory")
                return (self._compile(spec, arch, key) if data is None else data), None
            return data, target / name

    @staticmethod
    def _compile(spec: jit.KernelSpec, arch: str, key: str) -> bytes:
        start = time.perf_counter()
        cubin = jit.compile_kernel(spec, arch, key).cubin
        config.log.info("compiled %s for %s in %.2f s", spec.describe(), arch, time.perf_counter() - start)
        return cubin

    # ------------------------------------------------------------ loaded kernels

    def launcher(self, device_index: int, spec: jit.KernelSpec) -> Launcher:
        """The loaded kernel of ``spec`` on device ``device_index``; built on first use.

        Keyed by the spec's type as well as its fields: specs of two kernel families never share
        a kernel, even with equal fields. The hot path is one dict lookup. Safe under concurrent
        first calls: one thread builds, the others wait and share it.
        """
        key = (device_index, type(spec), spec)
        found = self._launchers.get(key)
        if found is None:
            with self._lock:
                found = self._launchers.get(key)
                if found is None:
                    gpu = device_info(device_index)
                    data, _ = self.build(spec, gpu.arch)
                    found = self._launchers[key] = Launcher(data, spec.template, gpu)
        return found


_default: KernelCache | None = None


def default() -> KernelCache:
    """The process's kernel cache, its layers read from the environment at first use."""
    global _default
    if _default is None:
        _default = KernelCache()
    return _default
