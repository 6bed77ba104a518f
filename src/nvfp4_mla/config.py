"""What the library reads from its environment, its logger and its install hints: one home.

Environment variables (docs/format.md sections 7 and 11):

- ``NVFP4_MLA_CACHE_DIR``: kernel cache directories searched before the per-user default (a
  ``:``-separated list, ``~`` expanded), read when the process first uses the kernel cache;
- ``NVFP4_MLA_CACHE_TRUST_GROUP``: also trust kernel files that a group of yours may write (read
  at each check);
- ``NVFP4_MLA_LOCK_TIMEOUT``: how many seconds a compile waits for another process's lock on the
  same kernel before it compiles in memory (read at each compile; default 600);
- ``NVFP4_MLA_CHECK``: the host-side debugging checks of the writers (read at import into
  :data:`DEBUG_CHECKS`, which tests and notebooks may set).

A boolean variable takes 1/0, true/false, yes/no or on/off (any case, surrounding space
ignored); unset or empty, it keeps its default. Any other value is not guessed at: it keeps the
default, with one warning per process.
"""

from __future__ import annotations

import logging
import math
import os
import warnings
from pathlib import Path

log = logging.getLogger("nvfp4_mla")
log.addHandler(logging.NullHandler())  # the library logs; the application decides where

CACHE_DIR_ENV = "NVFP4_MLA_CACHE_DIR"
TRUST_GROUP_ENV = "NVFP4_MLA_CACHE_TRUST_GROUP"
CHECK_ENV = "NVFP4_MLA_CHECK"
LOCK_TIMEOUT_ENV = "NVFP4_MLA_LOCK_TIMEOUT"
# Far above the longest compile of the catalogue (tens of seconds), so a waiting process gives up
# only on a lock that a hung or stopped process holds.
DEFAULT_LOCK_TIMEOUT = 600.0

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
warned_messages: set[str] = set()  # what warn_once has warned about in this process


def warn_once(message: str) -> None:
    """Logs ``message`` and warns with it as the kernel cache does (a ``RuntimeWarning`` starting
    with ``nvfp4_mla:``), the first time in this process only: a setting is read again at each
    check, and one warning is enough."""
    if message not in warned_messages:
        warned_messages.add(message)
        log.warning(message)
        warnings.warn(f"nvfp4_mla: {message}", RuntimeWarning, stacklevel=3)


def env_flag(name: str, default: bool = False) -> bool:
    """The boolean variable ``name``: 1/0, true/false, yes/no, on/off; else ``default``."""
    value = os.environ.get(name, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    if value:  # "false" once meant on (anything but "" or "0"): a value not understood is not guessed
        warn_once(
            f"{name}={os.environ[name]!r} is not a boolean (1/0, true/false, yes/no, on/off): "
            f"{name} stays {'on' if default else 'off'}"
        )
    return default


# Every writer entry, kernel and reference, also runs validation.debug_check_rows (a host
# synchronisation) when this is true.
DEBUG_CHECKS = env_flag(CHECK_ENV)


def trust_group() -> bool:
    """Whether ``NVFP4_MLA_CACHE_TRUST_GROUP`` opts into group-writable kernel files."""
    return env_flag(TRUST_GROUP_ENV)


def lock_timeout() -> float:
    """How long, in seconds, a compile waits for another process's lock on its kernel:
    ``NVFP4_MLA_LOCK_TIMEOUT`` (a number >= 0; ``inf`` waits for ever), else
    :data:`DEFAULT_LOCK_TIMEOUT` (with a warning when the value is not such a number)."""
    raw = os.environ.get(LOCK_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_LOCK_TIMEOUT
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not seconds >= 0:  # NaN too
        warn_once(f"{LOCK_TIMEOUT_ENV}={raw!r} is not a number of seconds >= 0: {DEFAULT_LOCK_TIMEOUT:g} s is used")
        return DEFAULT_LOCK_TIMEOUT
    return seconds


def _home() -> Path | None:
    """This user's home directory, or None when there is none: HOME unset and no passwd entry
    for the uid (``Path.home()`` raises then), or HOME not an absolute path (a relative one would
    put the cache in the working directory)."""
    home = os.path.expanduser("~")
    return Path(home) if os.path.isabs(home) else None


def default_cache_dir() -> Path | None:
    """The per-user kernel cache: ``$XDG_CACHE_HOME/nvfp4_mla``, else ``~/.cache/nvfp4_mla``; None
    (with one warning) when neither is known. A relative ``XDG_CACHE_HOME`` is ignored, as the XDG
    Base Directory specification says: the cache never lands in the working directory."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        return Path(xdg) / "nvfp4_mla"
    if xdg:
        warn_once(f"XDG_CACHE_HOME={xdg!r} is not an absolute path: ignored, as the XDG specification says")
    home = _home()
    if home is None:
        warn_once(
            f"no home directory (HOME unset with no passwd entry for uid {os.getuid()}, or not an absolute "
            "path) and no XDG_CACHE_HOME: the per-user kernel cache is skipped"
        )
        return None
    return home / ".cache" / "nvfp4_mla"


def cache_dirs() -> list[Path]:
    """The kernel cache's lookup layers: ``$NVFP4_MLA_CACHE_DIR`` (a path list, ``~`` expanded),
    then the per-user default when there is one (:func:`default_cache_dir`). An entry whose ``~``
    cannot be expanded (no home) is skipped with a warning, never taken as a directory named ``~``."""
    listed = []
    for entry in os.environ.get(CACHE_DIR_ENV, "").split(os.pathsep):
        expanded = os.path.expanduser(entry)
        if expanded.startswith("~"):
            warn_once(f"{CACHE_DIR_ENV} entry {entry!r} skipped: its ~ cannot be expanded (no such home)")
        elif expanded:
            listed.append(Path(expanded))
    default = default_cache_dir()
    return listed + ([] if default is None or default in listed else [default])


def _from_checkout() -> bool:
    """Whether the package runs from a source checkout (``src/nvfp4_mla`` beside ``pyproject.toml``)."""
    return (Path(__file__).resolve().parents[2] / "pyproject.toml").is_file()


def install_hint(extra: str = "cu12") -> str:
    """The command that installs the GPU extra, as this package was installed: ``pip install -e``
    from a checkout, else the published package."""
    return f"pip install -e '.[{extra}]'" if _from_checkout() else f"pip install 'nvfp4-mla[{extra}]'"


def cupy_fix(exc: BaseException | None = None) -> str:
    """What to do when CuPy or NVRTC cannot be used (``exc``: what importing or calling it raised)."""
    if isinstance(exc, OSError):  # CuPy is there but cannot create its cache directory (~/.cupy)
        return "CuPy cannot create its cache directory: set CUPY_CACHE_DIR to a directory you can write, or HOME"
    return f"install CuPy and NVRTC for your CUDA: {install_hint('cu12')} (or [cu13] for a CUDA 13 driver)"
