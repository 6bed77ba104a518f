"""The cache of compiled kernels: trusted layers on disk, one compile per key, loaded kernels.

It runs only what it built for that key (docs/format.md section 11, which states the threat
model): a file is used when its directory and itself pass the ownership rules (:func:`distrust`)
and its bytes pass :func:`nvfp4_mla.kernel_file.unpack` (a whole cubin for this architecture, this
key's proof inside its loaded image, a digest over every byte). Every operation on a directory goes
through one opened descriptor, so a swap of the path after the check changes nothing. Anything
else, the driver's refusal of an image included, is a miss with one warning that names the file
and the reason, and the kernel is compiled afresh: never a crash. Calls after the first do one dict
lookup. Finding, checking and loading a file needs no NVRTC: the key holds nothing of the compiler,
and the NVRTC a file records is compared only when this process has compiled (a mismatch is
logged and the file used).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import stat
import threading
import time
import warnings
from collections.abc import Collection
from pathlib import Path

from . import config, jit, kernel_file
from .device import device_info
from .launch import Launcher, LoadError

STALE_TEMP_SECONDS = 3600  # a temp file of ours this old was left by a killed process
TEMP_PREFIX = ".nvfp4_mla-"  # the library's temp files: .nvfp4_mla-<random>.tmp; cleanup touches no other
LOCK_SUFFIX = ".lock"
PRIVATE_MODE = 0o700  # the per-user cache: nobody else reads it
IMAGE_MODE = 0o755  # precompile's directory: other users of the image read it, only its owner writes


class CacheError(RuntimeError):
    """A directory asked for explicitly cannot hold kernels (unwritable or untrusted)."""


class Refused(Exception):
    """A directory or file that must not be used; ``str(error)`` is the reason."""


def _my_groups() -> set[int]:
    return {os.getegid(), *os.getgroups()}


def distrust(st: os.stat_result, what: str, shared: bool = False) -> str | None:
    """Why a file or directory with status ``st`` may not be trusted, or None.

    Owned by this user or root and writable by neither group nor others (ssh's StrictModes). With
    ``NVFP4_MLA_CACHE_TRUST_GROUP`` also: group-writable when its group is one of this user's
    groups, and owned by another user when ``shared`` (a directory, or a file in a directory trusted
    through its group) and its group is one of this user's groups."""
    if st.st_mode & stat.S_IWOTH:
        return f"{what} is writable by others"
    in_my_group = config.trust_group() and st.st_gid in _my_groups()
    if st.st_mode & stat.S_IWGRP and not in_my_group:
        mine = " (not one of this user's groups)" if config.trust_group() else ""
        return f"{what} is writable by its group, gid {st.st_gid}{mine}"
    if st.st_uid not in (os.geteuid(), 0) and not (shared and in_my_group):
        return f"{what} is owned by uid {st.st_uid}, not by this user or root"
    return None


def _shared_through_group(st: os.stat_result) -> bool:
    """A directory trusted through the group opt-in: group-writable, of one of this user's groups."""
    return bool(st.st_mode & stat.S_IWGRP) and config.trust_group() and st.st_gid in _my_groups()


def open_dir(path: Path) -> tuple[int, os.stat_result]:
    """A trusted directory's descriptor and status; FileNotFoundError when it is absent, else
    :class:`Refused` with the reason. A symbolic link is followed only when this user or root owns it."""
    link = os.lstat(path)
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (os.geteuid(), 0):
        raise Refused(f"it is a symbolic link owned by uid {link.st_uid}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise Refused(f"it cannot be opened ({exc.strerror or exc})") from None
    st = os.fstat(fd)
    reason = distrust(st, "it", shared=True)
    if reason is not None:
        os.close(fd)
        raise Refused(reason)
    return fd, st


def prepare_dir(directory: Path, mode: int = PRIVATE_MODE) -> str | None:
    """Makes ``directory`` ready to receive kernels; returns why it cannot, or None. A directory
    this creates gets ``mode`` (whatever the umask) through a descriptor opened without following a
    link, never by path: precompile may run as root under a parent others can write, and a symbolic
    link swapped in after the mkdir must not hand it another file to chmod. Parent directories
    (created with the umask's mode when missing) are not judged."""
    try:
        directory.mkdir(mode, parents=True)  # never wider than mode, even before the fchmod
    except FileExistsError:
        pass
    except OSError as exc:
        return f"cannot create {directory}: {exc.strerror or exc}"
    else:
        reason = _set_mode(directory, mode)
        if reason is not None:
            return f"{directory}: {reason}"
    try:
        fd, _ = open_dir(directory)
    except (Refused, OSError) as exc:
        return f"{directory}: {exc}"
    os.close(fd)
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"{directory} is not writable by this user"
    return None


def _set_mode(directory: Path, mode: int) -> str | None:
    """Gives the directory just created at ``directory`` its ``mode``, through a descriptor: None,
    or why not (the path no longer names a directory of this user: swapped after the mkdir)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "replaced by a symbolic link after it was created"
        return f"it cannot be opened after it was created ({exc.strerror or exc})"
    try:
        owner = os.fstat(fd).st_uid
        if owner != os.geteuid():
            return f"replaced after it was created (now owned by uid {owner})"
        os.fchmod(fd, mode)
    except OSError as exc:
        return f"cannot set its mode ({exc.strerror or exc})"
    finally:
        os.close(fd)
    return None


def _file_bytes(dir_fd: int, dir_st: os.stat_result, name: str) -> bytes | None:
    """The bytes of the file ``name`` of an opened directory, None when there is none;
    :class:`Refused` when it must not be read (opened without following links or blocking, a
    regular file of a trusted owner, its size capped before it is read)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise Refused("a symbolic link" if exc.errno == errno.ELOOP else exc.strerror or str(exc)) from None
    try:
        st = os.fstat(fd)
        reason = "not a regular file" if not stat.S_ISREG(st.st_mode) else kernel_file.check_size(st.st_size)
        reason = reason or distrust(st, "the file", shared=_shared_through_group(dir_st))
        if reason is not None:
            raise Refused(reason)
        chunks, left = [], st.st_size
        while left > 0 and (chunk := os.read(fd, left)):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError as exc:
        raise Refused(exc.strerror or str(exc)) from None
    finally:
        os.close(fd)


def read_kernel(dir_fd: int, dir_st: os.stat_result, name: str, key: str, arch: str) -> kernel_file.KernelFile | None:
    """The kernel file ``name`` of an opened directory, None when there is none; :class:`Refused`
    when a file is there but must not run (opened without following links or blocking, its size
    capped before it is read, then :func:`nvfp4_mla.kernel_file.read`)."""
    data = _file_bytes(dir_fd, dir_st, name)
    if data is None:
        return None
    try:
        return kernel_file.read(data, key, arch)
    except kernel_file.KernelFileError as exc:
        raise Refused(str(exc)) from None


def read_recorded_kernel(dir_fd: int, dir_st: os.stat_result, name: str) -> kernel_file.KernelFile | None:
    """:func:`read_kernel` for the key and arch the file records (``nvfp4-mla info`` knows only
    the name): the same checks, and :class:`Refused` also when ``name`` is not that kernel's, since
    a lookup of the kernel its name stands for refuses it."""
    data = _file_bytes(dir_fd, dir_st, name)
    if data is None:
        return None
    try:
        key, arch = kernel_file.packed_for(data)
        if KernelCache.file_name(key, arch) != name:
            raise Refused(f"packed for {arch[:16]}, key {key[:16]}..., not the kernel its name stands for")
        return kernel_file.read(data, key, arch)
    except kernel_file.KernelFileError as exc:
        raise Refused(str(exc)) from None


class LockTimeout(Exception):
    """Another process held a kernel's lock longer than :func:`nvfp4_mla.config.lock_timeout`."""


class _FileLock:
    """An exclusive lock on ``name`` of an opened directory (one compile per key across processes).
    The lock file is opened relative to the directory, never through a symbolic link; ``remove``
    deletes it on release (precompile into an image directory, as its only writer). Waits at most
    ``timeout`` seconds for another holder, then raises :class:`LockTimeout`: a hung or stopped
    process must not stall every later compile of its key for ever."""

    def __init__(self, dir_fd: int, name: str, remove: bool, timeout: float):
        self.dir_fd, self.name, self.remove, self.timeout = dir_fd, name, remove, timeout

    def __enter__(self) -> None:
        flags = os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        self.fd = os.open(self.name, flags, 0o644, dir_fd=self.dir_fd)
        try:
            if not stat.S_ISREG(os.fstat(self.fd).st_mode):
                raise OSError(f"{self.name} is not a regular file")
            self._wait()
        except BaseException:
            os.close(self.fd)
            raise

    def _wait(self) -> None:
        """Takes the lock, polling: flock has no timeout, and an alarm signal is the application's."""
        deadline = time.monotonic() + self.timeout
        pause = 0.001
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LockTimeout(f"{self.name} was held by another process for over {self.timeout:g} s") from None
                time.sleep(min(pause, left))
                pause = min(2 * pause, 0.1)  # prompt when the holder is quick, cheap when it is slow

    def __exit__(self, *exc: object) -> None:
        try:
            if (
                self.remove
                and os.stat(self.name, dir_fd=self.dir_fd, follow_symlinks=False).st_ino == os.fstat(self.fd).st_ino
            ):
                os.unlink(self.name, dir_fd=self.dir_fd)
        except OSError:
            pass
        finally:
            os.close(self.fd)  # releases the lock


def publish(dir_fd: int, name: str, data: bytes) -> None:
    """Writes ``data`` as ``name`` of an opened directory atomically (a temp file of ours, fsync,
    mode 0644, rename), after removing this user's temp files that killed processes left."""
    now = time.time()
    with os.scandir(dir_fd) as entries:
        for entry in entries:
            if not (entry.name.startswith(TEMP_PREFIX) and entry.name.endswith(".tmp")):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and now - st.st_mtime > STALE_TEMP_SECONDS:
                    os.unlink(entry.name, dir_fd=dir_fd)
            except OSError:
                pass
    tmp = f"{TEMP_PREFIX}{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            os.fchmod(f.fileno(), 0o644)  # readable by the users a shared precompiled set serves
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


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
        self._compiles = 0  # compiles this cache ran (a driver's refusal of one just compiled is an error)

    def _warn(self, message: str) -> None:
        config.log.warning(message)
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(f"nvfp4_mla: {message}", RuntimeWarning, stacklevel=4)

    # ------------------------------------------------------------ layers

    def layer_status(self, directory: Path) -> str:
        """How ``directory`` serves: "trusted", "not created yet" or "refused: <reason>"."""
        try:
            fd, _ = open_dir(directory)
        except FileNotFoundError:
            return "not created yet"
        except (Refused, OSError) as exc:
            return f"refused: {exc}"
        os.close(fd)
        return "trusted"

    def writable_dir(self) -> Path | None:
        """The layer misses compile into, or None (memory only)."""
        if self._writable is False:
            reasons = []
            for directory in self.layers:
                reason = prepare_dir(directory)
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
        """``<arch>-<key prefix>.v<format>.cubin``: files of another format are never looked up."""
        return f"{arch}-{key[:32]}.v{kernel_file.FORMAT_VERSION}.cubin"

    def _read(
        self, dir_fd: int, dir_st: os.stat_result, directory: Path, name: str, key: str, arch: str
    ) -> bytes | None:
        try:
            found = read_kernel(dir_fd, dir_st, name, key, arch)
        except Refused as exc:
            self._warn(f"kernel cache file {directory / name} refused: {exc}; compiling it afresh")
            return None
        if found is None:
            return None
        ours = jit.loaded_nvrtc()  # never loads NVRTC: compared only when this process compiled
        if ours is not None and found.compiler != ours:
            config.log.debug(
                "kernel %s was compiled by NVRTC %s, this process has %s: used all the same "
                "(its key covers every input of the compile)",
                directory / name,
                found.compiler.describe(),
                ours.describe(),
            )
        return found.cubin

    def lookup(self, key: str, arch: str, skip: Collection[Path] = ()) -> tuple[bytes, Path] | None:
        """The first trusted layer's kernel of ``key``, with its path; None on a miss. A refused or
        unreadable layer is skipped with a warning; so is a file in ``skip`` (the driver refused it)."""
        name = self.file_name(key, arch)
        for directory in self.layers:
            if directory / name in skip:
                continue
            try:
                fd, st = open_dir(directory)
            except FileNotFoundError:
                continue
            except (Refused, OSError) as exc:
                self._warn(f"kernel cache {directory} ignored: {exc}")
                continue
            try:
                data = self._read(fd, st, directory, name, key, arch)
            finally:
                os.close(fd)
            if data is not None:
                config.log.debug("kernel %s found in %s", name, directory)
                return data, directory / name
        return None

    def build(
        self, spec: jit.KernelSpec, arch: str, directory: Path | None = None, skip: Collection[Path] = ()
    ) -> tuple[bytes, Path | None]:
        """The verified cubin of ``spec`` for a GPU of ``arch`` (built for
        :func:`jit.target_arch`, e.g. sm_90a) and where it lies (None: memory only), compiling on a
        miss. With ``directory``, it compiles into exactly that directory (or raises
        :class:`CacheError`), which it creates readable by others and leaves no lock file in.
        ``skip``: files not to use (the driver refused them); other layers still serve, and one in
        the writable layer is compiled over. One compile per key across threads and processes."""
        arch = jit.target_arch(spec, jit.check_arch(arch))
        key = jit.kernel_key(spec, arch)
        name = self.file_name(key, arch)
        with self._lock:
            if directory is None:
                found = self.lookup(key, arch, skip)
                if found is not None:
                    return found
                target = self.writable_dir()
            else:
                reason = prepare_dir(directory, IMAGE_MODE)
                if reason is not None:
                    raise CacheError(f"cannot write kernels into {directory}: {reason}")
                target = directory
            if target is None:
                return self._compile(spec, arch, key), None
            fresh = target / name in skip
            data = None
            try:
                fd, st = open_dir(target)
                try:
                    with _FileLock(fd, name + LOCK_SUFFIX, directory is not None, config.lock_timeout()):
                        if not fresh:  # another process may have built it
                            data = self._read(fd, st, target, name, key, arch)
                        if data is None:
                            data = self._compile(spec, arch, key)
                            publish(fd, name, kernel_file.pack(data, key, arch, jit.nvrtc_build()))
                finally:
                    os.close(fd)
            except LockTimeout as exc:  # its holder hangs or was stopped: compile without waiting for it
                if directory is not None:
                    raise CacheError(f"cannot write kernels into {directory}: {exc}") from exc
                self._warn(
                    f"kernel cache {target}: {exc} ({config.LOCK_TIMEOUT_ENV}); "
                    "this kernel is compiled in memory and not written"
                )
                return self._compile(spec, arch, key), None
            except (OSError, Refused) as exc:  # the directory changed under us (removed, made read-only, ...)
                if directory is not None:
                    raise CacheError(f"cannot write kernels into {directory}: {exc}") from exc
                self._warn(f"kernel cache {target} failed ({exc}); this kernel is kept in memory")
                return (self._compile(spec, arch, key) if data is None else data), None
            return data, target / name

    def _compile(self, spec: jit.KernelSpec, arch: str, key: str) -> bytes:
        self._compiles += 1  # under self._lock
        start = time.perf_counter()
        cubin = jit.compile_kernel(spec, arch, key).cubin
        config.log.info("compiled %s for %s in %.2f s", spec.describe(), arch, time.perf_counter() - start)
        return cubin

    # ------------------------------------------------------------ loaded kernels

    def launcher(self, device_index: int, spec: jit.KernelSpec) -> Launcher:
        """The loaded kernel of ``spec`` on device ``device_index``; built on first use.

        Keyed by the spec's type as well as its fields: specs of two kernel families never share
        a kernel, even with equal fields. A cached file the driver refuses is compiled afresh
        (with a warning). The hot path is one dict lookup. Safe under concurrent first calls: one
        thread builds, the others wait and share it.
        """
        key = (device_index, type(spec), spec)
        found = self._launchers.get(key)
        if found is None:
            with self._lock:
                found = self._launchers.get(key)
                if found is None:
                    found = self._load(device_index, spec)
                    self._launchers[key] = found
        return found

    def _load(self, device_index: int, spec: jit.KernelSpec) -> Launcher:
        """Loads ``spec``'s kernel, trying the next layer's file, then a fresh compile, when the
        driver refuses one (a file compiled by a newer NVRTC than this driver takes, say: it stays
        refused in its read-only image, and the kernel compiled afresh into a later layer must then
        be found there by every later process, not compiled again)."""
        gpu = device_info(device_index)
        refused: list[Path] = []
        while True:
            compiles = self._compiles
            data, path = self.build(spec, gpu.arch, skip=refused)
            try:
                return Launcher(data, spec.template, gpu)
            except LoadError as exc:
                if path is None or self._compiles != compiles:  # compiled just now: no file to blame
                    raise
                self._warn(
                    f"kernel cache file {path} refused by the driver ({exc}); "
                    "using a later layer's file or compiling it afresh"
                )
                refused.append(path)


_default: KernelCache | None = None


def default() -> KernelCache:
    """The process's kernel cache, its layers read from the environment at first use."""
    global _default
    if _default is None:
        _default = KernelCache()
    return _default
