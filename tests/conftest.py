"""Shared fixtures. GPU tests carry ``@pytest.mark.gpu`` and skip, with the reason, without a usable GPU."""

import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from nvfp4_mla import gpu_unavailable_reason

GPU_SKIP_REASON = gpu_unavailable_reason()
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", ... under pytest-xdist (make test)
_WORKER_TMP = pytest.StashKey[str]()


def pytest_configure(config):
    """Each pytest-xdist worker gets its own temp directory (TMPDIR, for its subprocesses too), so
    a test that compares the temp directory's listing before and after a call
    (test_cache.py's no-temp-dirs check) sees no files of a test running on another worker (the
    benchmark's first-use probe makes one). Mode 1777 like /tmp: tests run children as another user."""
    if XDIST_WORKER is None:
        return
    private = tempfile.mkdtemp(prefix=f"pytest-xdist-{XDIST_WORKER}-")
    os.chmod(private, 0o1777)
    os.environ["TMPDIR"] = tempfile.tempdir = private
    config.stash[_WORKER_TMP] = private


def pytest_unconfigure(config):
    private = config.stash.get(_WORKER_TMP, None)
    if private is not None:
        shutil.rmtree(private, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if GPU_SKIP_REASON is None:
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, config):
    """-ra's skip lines, one per reason with its count: pytest folds skips by file and line, so
    the GPU marker alone made dozens of lines. Runs before pytest's short summary, which prints
    them; ``-v`` keeps pytest's own lines (each file and line)."""
    skipped = terminalreporter.stats.get("skipped", [])
    if config.get_verbosity() > 0 or not skipped:
        return
    by_reason: dict[str, list] = {}
    for report in skipped:
        if isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
            by_reason.setdefault(report.longrepr[2], []).append(report)
    for reason, reports in by_reason.items():
        files = sorted({Path(report.longrepr[0]) for report in reports})
        where, note = (files[0], "") if len(files) == 1 else (Path(os.path.commonpath(files)), f" ({len(files)} files)")
        for report in reports:
            report.longrepr = (str(where), None, reason + note)


@pytest.fixture
def seed():
    """A fresh seed every run, printed so a failure can be replayed (pytest -s shows it): set
    NVFP4_MLA_TEST_SEED to that number to run with it."""
    fixed = os.environ.get("NVFP4_MLA_TEST_SEED")
    s = int(fixed) if fixed else random.SystemRandom().randrange(2**31)
    print(f"seed={s}")
    torch.manual_seed(s)
    return s
