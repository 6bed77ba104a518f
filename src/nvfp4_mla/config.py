"""What the library reads from its environment, its logger and its install hints: one home.

Environment variables (docs/format.md sections 7 and 11):

- ``NVFP4_MLA_CACHE_DIR``: kernel cache directories searched before the per-user default (a
  ``:``-separated list), read when the process first uses the kernel cache;
- ``NVFP4_MLA_CACHE_TRUST_GROUP``: also trust kernel files that a group of yours may write (read
  at each check);
- ``NVFP4_MLA_CHECK``: the host-side debugging checks of the writers (read at import into
  :data:`DEBUG_CHECKS`, which tests and notebooks may set).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("nvfp4_mla")

CACHE_DIR_ENV = "NVFP4_MLA_CACHE_DIR"
TRUST_GROUP_ENV = "NVFP4_MLA_CACHE_TRUST_GROUP"
CHECK_ENV = "NVFP4_MLA_CHECK"


def _flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0")


# Every writer entry, kernel and reference, also runs validation.debug_check_rows (a host
# synchronisation) when this is true.
DEBUG_CHECKS = _flag(CHECK_ENV)


def trust_group() -> bool:
    """Whether ``NVFP4_MLA_CACHE_TRUST_GROUP`` opts into group-writable kernel files."""
    return _flag(TRUST_GROUP_ENV)


def default_cache_dir() -> Path:
    """The per-user kernel cache: ``$XDG_CACHE_HOME/nvfp4_mla``, else ``~/.cache/nvfp4_mla``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nvfp4_mla"


def cache_dirs() -> list[Path]:
    """The kernel cache's lookup layers: ``$NVFP4_MLA_CACHE_DIR`` (a path list), then the per-user default."""
    listed = [Path(p) for p in os.environ.get(CACHE_DIR_ENV, "").split(os.pathsep) if p]
    default = default_cache_dir()
    return listed + ([] if default in listed else [default])


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
