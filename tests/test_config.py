"""What the library reads from its environment (nvfp4_mla.config), with no GPU and no compiler:
boolean variables, the lock timeout, and where the kernel cache lives when the home directory or
XDG_CACHE_HOME is missing, relative or unusable."""

from __future__ import annotations

import math
import os
import pwd
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import nvfp4_mla
from nvfp4_mla import config

SOURCE_ROOT = str(Path(nvfp4_mla.__file__).resolve().parents[1])


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test starts with no setting warned about (config warns once per process)."""
    monkeypatch.setattr(config, "warned_messages", set())


def caught(call):
    """``call()``'s value and the texts of the warnings it raised."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        value = call()
    return value, [str(w.message) for w in seen]


@pytest.mark.parametrize(
    "value, expected",
    [
        ("1", True),
        ("true", True),
        (" TRUE ", True),
        ("Yes", True),
        ("on\n", True),
        ("0", False),
        ("false", False),
        (" False\t", False),
        ("NO", False),
        ("off", False),
    ],
)
@pytest.mark.parametrize("default", [False, True])
def test_boolean_values(monkeypatch, value, expected, default):
    monkeypatch.setenv("NVFP4_MLA_TEST_FLAG", value)
    assert caught(lambda: config.env_flag("NVFP4_MLA_TEST_FLAG", default)) == (expected, [])


@pytest.mark.parametrize("default", [False, True])
def test_an_unset_or_empty_flag_keeps_its_default_silently(monkeypatch, default):
    monkeypatch.delenv("NVFP4_MLA_TEST_FLAG", raising=False)
    assert caught(lambda: config.env_flag("NVFP4_MLA_TEST_FLAG", default)) == (default, [])
    monkeypatch.setenv("NVFP4_MLA_TEST_FLAG", "  ")
    assert caught(lambda: config.env_flag("NVFP4_MLA_TEST_FLAG", default)) == (default, [])


def test_an_unknown_flag_value_warns_once_and_keeps_the_default(monkeypatch):
    monkeypatch.setenv("NVFP4_MLA_CACHE_TRUST_GROUP", "maybe")
    first, texts = caught(config.trust_group)
    again, more = caught(config.trust_group)
    assert (first, again, more) == (False, False, [])
    assert len(texts) == 1 and "NVFP4_MLA_CACHE_TRUST_GROUP='maybe' is not a boolean" in texts[0], texts


def test_false_turns_the_group_opt_in_off(monkeypatch):
    """It once meant on: anything but "" or "0" did."""
    for value in ("false", "no", "off"):
        monkeypatch.setenv("NVFP4_MLA_CACHE_TRUST_GROUP", value)
        assert config.trust_group() is False


@pytest.mark.parametrize("value, checks", [("false", False), ("Off", False), ("true", True)])
def test_the_check_variable_read_at_import(value, checks):
    """``NVFP4_MLA_CHECK=false`` once turned the checks on; a new process reads it at import."""
    done = subprocess.run(
        [sys.executable, "-c", "from nvfp4_mla import config; print(config.DEBUG_CHECKS)"],
        env={**os.environ, "PYTHONPATH": SOURCE_ROOT, "NVFP4_MLA_CHECK": value},
        capture_output=True,
        text=True,
        cwd="/",
    )
    assert done.returncode == 0 and done.stdout.split() == [str(checks)], done.stderr


@pytest.mark.parametrize(
    "value, seconds", [(None, 600.0), ("", 600.0), ("2.5", 2.5), (" 0 ", 0.0), ("30", 30.0), ("inf", math.inf)]
)
def test_lock_timeout(monkeypatch, value, seconds):
    if value is None:
        monkeypatch.delenv("NVFP4_MLA_LOCK_TIMEOUT", raising=False)
    else:
        monkeypatch.setenv("NVFP4_MLA_LOCK_TIMEOUT", value)
    assert caught(config.lock_timeout) == (seconds, [])
    assert config.DEFAULT_LOCK_TIMEOUT == 600.0


@pytest.mark.parametrize("value", ["-1", "soon", "nan", "10s"])
def test_a_bad_lock_timeout_warns_once_and_keeps_the_default(monkeypatch, value):
    monkeypatch.setenv("NVFP4_MLA_LOCK_TIMEOUT", value)
    seconds, texts = caught(config.lock_timeout)
    assert seconds == config.DEFAULT_LOCK_TIMEOUT and len(texts) == 1 and "NVFP4_MLA_LOCK_TIMEOUT" in texts[0]
    assert caught(config.lock_timeout) == (config.DEFAULT_LOCK_TIMEOUT, [])


@pytest.fixture
def homeless(monkeypatch):
    """HOME unset and no passwd entry for this uid: ``Path.home()`` raises."""
    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)

    def no_entry(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    with pytest.raises(RuntimeError):
        Path.home()


def test_no_home_skips_the_per_user_layer_with_one_warning(tmp_path, homeless, monkeypatch):
    monkeypatch.setenv("NVFP4_MLA_CACHE_DIR", str(tmp_path / "k"))
    layers, texts = caught(config.cache_dirs)
    assert layers == [tmp_path / "k"]
    assert len(texts) == 1 and "no home directory" in texts[0] and "per-user kernel cache is skipped" in texts[0]
    assert caught(config.cache_dirs) == ([tmp_path / "k"], [])  # one warning per process
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # needs no home
    assert config.cache_dirs() == [tmp_path / "k", tmp_path / "xdg" / "nvfp4_mla"]


@pytest.mark.parametrize("home", ["relative/home", "."])
def test_a_relative_home_is_no_home(monkeypatch, tmp_path, home):
    """Never a cache in the working directory (it was ``relative/home/.cache/nvfp4_mla``)."""
    monkeypatch.setenv("HOME", home)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("NVFP4_MLA_CACHE_DIR", str(tmp_path / "k"))
    layers, texts = caught(config.cache_dirs)
    assert layers == [tmp_path / "k"] and len(texts) == 1 and "no home directory" in texts[0]


def test_the_cache_dir_list_expands_a_tilde(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("NVFP4_MLA_CACHE_DIR", os.pathsep.join(["~/k", "", "/opt/kernels"]))
    assert caught(config.cache_dirs) == (
        [tmp_path / "k", Path("/opt/kernels"), tmp_path / ".cache" / "nvfp4_mla"],
        [],
    )


def test_a_tilde_without_a_home_is_skipped_not_taken_literally(tmp_path, homeless, monkeypatch):
    monkeypatch.setenv("NVFP4_MLA_CACHE_DIR", os.pathsep.join(["~/k", str(tmp_path / "k")]))
    layers, texts = caught(config.cache_dirs)
    assert layers == [tmp_path / "k"]
    assert any("'~/k' skipped" in t for t in texts) and any("no home directory" in t for t in texts), texts


@pytest.mark.parametrize("xdg", ["relative/cache", ".", "~/cache"])
def test_a_relative_xdg_cache_home_is_ignored(monkeypatch, tmp_path, xdg):
    """The XDG Base Directory specification: a relative path is invalid and ignored."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", xdg)
    monkeypatch.delenv("NVFP4_MLA_CACHE_DIR", raising=False)
    layers, texts = caught(config.cache_dirs)
    assert layers == [tmp_path / ".cache" / "nvfp4_mla"]
    assert len(texts) == 1 and "XDG_CACHE_HOME" in texts[0] and "not an absolute path" in texts[0]


def test_an_absolute_xdg_cache_home_is_used(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("NVFP4_MLA_CACHE_DIR", raising=False)
    assert caught(config.cache_dirs) == ([tmp_path / "xdg" / "nvfp4_mla"], [])
