"""The command line on foreign input and on Ctrl-C: one ``error:`` line on stderr and exit status 2
(argparse's convention), or one ``interrupted`` line and exit status 130; never a traceback."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_cli import SRC, cache_env, run_module

from nvfp4_mla import kernel_cache, kernel_file, reference, validation
from nvfp4_mla.cli import main
from nvfp4_mla.geometry import Geometry
from nvfp4_mla.testing import make_cache

INTERRUPTED = "nvfp4-mla: interrupted"


def one_error_line(err: str, command: str) -> str:
    """The message of stderr's single ``nvfp4-mla COMMAND: error: ...`` line."""
    prefix = f"nvfp4-mla {command}: error: "
    assert err.startswith(prefix) and err.count("\n") == 1, err  # one line, no traceback
    return err[len(prefix) :].rstrip("\n")


def run_main(argv: list[str]) -> int:
    """``main(argv)``, failing the test (not stopping the session) on a KeyboardInterrupt it lets through."""
    try:
        return main(argv)
    except KeyboardInterrupt:
        pytest.fail("main let a KeyboardInterrupt through")


# ---------------------------------------------------------------- inspect


def _foreign_files(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """name -> (a file inspect refuses, a phrase of its message)."""
    files = {
        "passwd": (tmp_path / "passwd", "not a tensor saved with torch.save"),
        "meta": (tmp_path / "meta.pt", "holds a tensor on the meta device"),
        "nested": (tmp_path / "nested.pt", "holds a nested tensor, not a cache tensor"),
        "sparse": (tmp_path / "sparse.pt", "holds a sparse_csr tensor, not a cache tensor"),
    }
    # Text like /etc/passwd: the unpickler's IndexError, not one of torch.load's usual errors
    files["passwd"][0].write_text("root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1::/usr/sbin:/usr/sbin/nologin\n")
    torch.save(torch.empty(2, 16, 384, dtype=torch.uint8, device="meta"), files["meta"][0])
    torch.save(torch.nested.as_nested_tensor([make_cache(1, 4)[0]]), files["nested"][0])
    torch.save(make_cache(1, 4)[0].to_sparse_csr(), files["sparse"][0])
    return files


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta", "ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("slot", [[], ["--slot", "1"]], ids=["first written", "--slot"])
@pytest.mark.parametrize("case", ["passwd", "meta", "nested", "sparse"])
def test_inspect_foreign_files(capsys, tmp_path, case, slot):
    path, message = _foreign_files(tmp_path)[case]
    with pytest.raises(SystemExit) as exit_info:
        main(["inspect", str(path), *slot])
    assert exit_info.value.code == 2
    assert message in one_error_line(capsys.readouterr().err, "inspect")


# ---------------------------------------------------------------- demo


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (every write fails with ENOSPC)")
def test_demo_save_onto_a_full_disk(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--cpu", "--save", "/dev/full"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert one_error_line(err, "demo") == "--save /dev/full: cannot write it (No space left on device)"


# ---------------------------------------------------------------- info


def test_info_skips_a_dangling_symlink(tmp_path):
    """A kernel cache layer holding a ``*.cubin`` symbolic link to nowhere: info reports it (the
    cache never follows links, so it is never used) and lists the real kernels."""
    layer = tmp_path / "kernels"
    layer.mkdir(mode=0o700)
    (layer / f"sm_90-abc.v{kernel_file.FORMAT_VERSION}.cubin").write_bytes(b"x" * 100)
    link = layer / f"sm_90-gone.v{kernel_file.FORMAT_VERSION}.cubin"
    link.symlink_to(tmp_path / "nowhere")
    done = run_module("info", env=cache_env(tmp_path), capture_output=True)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stdout.split("kernel cache")[1].splitlines()[1:5]
    assert lines == [
        f"  {layer}",
        "    trusted",
        f"    1 *.cubin not a regular file (e.g. a symbolic link), never used: {link.name}",
        "    1 kernel, 100 B",
    ]


# ---------------------------------------------------------------- precompile


def test_precompile_refuses_an_empty_cache_dir(capsys, monkeypatch, tmp_path):
    """``--cache-dir ''`` is refused before any work, not taken as the working directory."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["precompile", "--kv-ratio", "1", "--arch", "sm_90", "--cache-dir", ""])
    assert exit_info.value.code == 2
    assert "argument --cache-dir: an empty path" in capsys.readouterr().err.splitlines()[-1]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("page_size", [2**40, 2**30])
@pytest.mark.parametrize("what", [["--kv-ratio", "1"], ["--read"], ["--decode"]], ids=["kv", "read", "decode"])
def test_precompile_refuses_a_page_size_no_entry_can_use(capsys, tmp_path, page_size, what):
    """A cache holds fewer than 2^30 slots (the writers' rule), so a page does too: refused with
    one line, also for a request that takes no page size."""
    argv = ["precompile", *what, "--page-size", str(page_size), "--arch", "sm_90", "--cache-dir", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "[1/" not in err  # before any work
    assert f"--page-size must be positive and below 2^30 (a cache holds fewer than 2^30 slots), got {page_size}" in err


def test_precompile_page_size_bound_is_the_entries():
    """The bound is validation's, for every request that takes a page size (nvfp4_mla.precompile too)."""
    assert validation.MAX_PAGE_SIZE == 2**30 - 1
    for entry in ("main", "kv", "append", "pack", "read"):
        g = Geometry(entry, validation.MAX_PAGE_SIZE, num_heads=8)
        assert g.specs("sm_90")  # the largest page size is a kernel
        with pytest.raises(ValueError, match=r"page_size must be a positive int below 2\^30"):
            g._replace(page_size=validation.MAX_PAGE_SIZE + 1).specs("sm_90")
    with pytest.raises(ValueError, match="fewer than 2\\^30"):  # the writers' rule it follows
        reference.nvfp4_quantize_append_sparse_mla_cache(
            torch.zeros(0, 512, dtype=torch.bfloat16),
            torch.zeros(0, dtype=torch.int64),
            torch.empty(1, 2**30, 384, dtype=torch.uint8, device="meta"),
        )


# ---------------------------------------------------------------- Ctrl-C


def test_interrupted_precompile(capsys, monkeypatch, tmp_path):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(kernel_cache.KernelCache, "build", interrupted)
    assert run_main(["precompile", "--kv-ratio", "1", "--arch", "sm_90", "--cache-dir", str(tmp_path)]) == 130
    err = capsys.readouterr().err
    assert err.splitlines() == ["[1/1] sm_90: kv, page 256, compress ratio 1, int64 slots", INTERRUPTED]


def test_interrupted_demo(capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(reference, "cake_dsv4_nvfp4_rope_quantize_insert", interrupted)
    assert run_main(["demo", "--cpu"]) == 130
    assert capsys.readouterr().err == INTERRUPTED + "\n"


# In a fresh interpreter, ``python -m nvfp4_mla ARGS`` whose first kernel build (precompile) or
# first write (demo) gets a real SIGINT, as from Ctrl-C: raise_signal runs Python's handler
# before it returns, so the KeyboardInterrupt comes from the signal, at a known point.
SIGINT_SCRIPT = """
import runpy, signal, sys
from nvfp4_mla import cli, kernel_cache, reference  # cli: every import done before the stand-ins go in

def ctrl_c(*args, **kwargs):
    signal.raise_signal(signal.SIGINT)
    raise AssertionError("SIGINT raised no KeyboardInterrupt")

kernel_cache.KernelCache.build = ctrl_c
reference.cake_dsv4_nvfp4_rope_quantize_insert = ctrl_c
sys.argv = ["nvfp4-mla", *sys.argv[1:]]
runpy.run_module("nvfp4_mla", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize(
    "argv", [["precompile", "--kv-ratio", "1", "--arch", "sm_90"], ["demo", "--cpu"]], ids=["precompile", "demo"]
)
def test_sigint_subprocess(tmp_path, argv):
    env = {**os.environ, "PYTHONPATH": SRC, **cache_env(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", SIGINT_SCRIPT, *argv], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 128 + signal.SIGINT
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1] == INTERRUPTED
    assert [line for line in done.stderr.splitlines() if not line.startswith("[")] == [INTERRUPTED]


# In a fresh interpreter, the command whose import of MODULE gets a real SIGINT: a Ctrl-C before
# cli.main's handler, while torch and the ops load (seconds). ENTRY is the console script's
# "module:function", called as its wrapper calls it, or "nvfp4_mla" for ``python -m nvfp4_mla``.
IMPORT_SIGINT_SCRIPT = """
import runpy, signal, sys

interrupted = sys.argv[1]
entry = sys.argv[2]

class CtrlC:
    def find_spec(self, name, path=None, target=None):
        if name == interrupted:
            signal.raise_signal(signal.SIGINT)
        return None

sys.meta_path.insert(0, CtrlC())
sys.argv = ["nvfp4-mla", "info"]
if ":" in entry:
    module, function = entry.split(":")
    sys.exit(getattr(__import__(module, fromlist=[function]), function)())
runpy.run_module(entry, run_name="__main__", alter_sys=True)
"""


def console_script() -> str:
    """The ``nvfp4-mla`` console script's entry, ``module:function``, as pyproject.toml declares it."""
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    found = re.search(r'^nvfp4-mla = "([\w.]+:\w+)"$', pyproject, re.M)
    assert found, "pyproject.toml declares no nvfp4-mla console script"
    return found.group(1)


@pytest.mark.parametrize("module", ["torch", "nvfp4_mla.cli"])
@pytest.mark.parametrize("how", ["console script", "python -m"])
def test_sigint_while_importing(tmp_path, module, how):
    entry = console_script() if how == "console script" else "nvfp4_mla"
    env = {**os.environ, "PYTHONPATH": SRC, **cache_env(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_SIGINT_SCRIPT, module, entry],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (done.returncode, done.stderr, done.stdout) == (128 + signal.SIGINT, INTERRUPTED + "\n", "")
