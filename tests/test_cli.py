"""The command line, on the CPU: info, demo (reference path), inspect, precompile (NVRTC, no GPU)."""

import hashlib
import io
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import nvfp4_mla
from nvfp4_mla import Geometry, abi, gpu_unavailable_reason, jit, kernel_cache, kernel_file, reference
from nvfp4_mla.cli import SIGPIPE_EXIT, format_record, main
from nvfp4_mla.cli.info import cache_summary
from nvfp4_mla.ops import decode
from nvfp4_mla.testing import CANARY, make_cache, random_rows, rope_table

SRC = str(Path(nvfp4_mla.__file__).resolve().parents[1])  # so a subprocess imports this checkout


def run_module(*args: str, **kwargs) -> subprocess.CompletedProcess:
    """``python -m nvfp4_mla ARGS`` in a fresh interpreter on this checkout (so the kernel cache is
    read from this environment)."""
    env = {**os.environ, "PYTHONPATH": SRC, **kwargs.pop("env", {})}
    return subprocess.run([sys.executable, "-m", "nvfp4_mla", *args], env=env, text=True, timeout=300, **kwargs)


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"nvfp4-mla {nvfp4_mla.__version__}\n"


def test_help_texts(capsys):
    for command, text in [("demo", "--seed SEED  seed of the random"), ("inspect", "path         a cache tensor")]:
        with pytest.raises(SystemExit):
            main([command, "-h"])
        assert text in capsys.readouterr().out


def cache_env(tmp_path: Path) -> dict[str, str]:
    """A kernel cache of its own: the layer tmp_path/kernels, then a per-user default in tmp_path."""
    return {"NVFP4_MLA_CACHE_DIR": str(tmp_path / "kernels"), "XDG_CACHE_HOME": str(tmp_path / "xdg")}


def test_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for word in (f"nvfp4-mla {nvfp4_mla.__version__}", "GPU:", "torch:", "CuPy:", "NVRTC:", "kernel cache"):
        assert word in out
    if not torch.cuda.is_available():
        assert "GPU:   no GPU" in out
    why_not = gpu_unavailable_reason()
    assert (f"GPU entries unavailable: {why_not}." in out) if why_not else ("unavailable" not in out)


def test_info_names_a_single_arch_once(capsys):
    """A backend of one architecture reads ``sm_90``, not ``sm_90-sm_90``."""
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for backend in decode.BACKENDS.values():
        low, high = backend.min_capability, backend.max_capability
        archs = f"sm_{low}" if low == high else f"sm_{low}+" if high >= 10**6 else f"sm_{low}-sm_{high}"
        assert re.search(rf"^          backend {backend.name}: {re.escape(archs)}(  \(.*\))?$", out, re.M), out
    assert re.search(r"sm_(\d+)-sm_\1\b", out) is None
    assert any(b.min_capability == b.max_capability for b in decode.BACKENDS.values())  # the case is covered


def test_info_lists_cache_layers_and_why_each_is_used_or_not(tmp_path):
    (tmp_path / "kernels").mkdir(mode=0o700)
    (tmp_path / "kernels" / f"sm_90-abc.v{kernel_file.FORMAT_VERSION}.cubin").write_bytes(b"x" * 100)
    (tmp_path / "kernels" / "sm_90-old.cubin").write_bytes(b"x" * 50)
    refused = tmp_path / "everyone"
    refused.mkdir()
    refused.chmod(0o777)
    env = {**cache_env(tmp_path), "NVFP4_MLA_CACHE_DIR": f"{refused}:{tmp_path / 'kernels'}"}
    done = run_module("info", env=env, capture_output=True)
    assert done.returncode == 0, done.stderr
    layers = done.stdout.split("kernel cache")[1].splitlines()[1:]
    assert layers == [
        f"  {refused}",
        "    refused: it is writable by others: not used",
        f"  {tmp_path / 'kernels'}",
        "    trusted; 1 kernel of an older format, never used (delete them)",
        "    1 kernel, 100 B",
        "    sm_90: 1 kernel, 100 B",
        "    1 kernel refused when read (compiled afresh at first use):",
        f"      sm_90-abc.v{kernel_file.FORMAT_VERSION}.cubin: cut or extended: no end marker",
        f"  {tmp_path / 'xdg' / 'nvfp4_mla'}",
        "    not created yet",
    ]


def write_kernel(layer: Path, page_size: int, arch: str, compiler: kernel_file.Compiler) -> Path:
    """The KV writer of ``page_size`` for ``arch`` as the cache writes it (NVRTC's cubin, packed
    under the kernel's file name), recording ``compiler``."""
    (spec,) = Geometry("kv", page_size).specs(arch)
    key = jit.kernel_key(spec, arch)
    path = layer / kernel_cache.KernelCache.file_name(key, arch)
    path.write_bytes(kernel_file.pack(jit.compile_kernel(spec, arch).cubin, key, arch, compiler))
    return path


def test_info_shows_the_nvrtc_each_kernel_records(tmp_path):
    """Per layer, the NVRTC each kernel file records (newest first), each file read as a lookup
    reads it; a file a lookup refuses is counted with its reason, and the others are still read:
    a kernel under another kernel's name, a cut one, an oversized one, junk under a name that is
    not UTF-8."""
    layer = tmp_path / "kernels"
    layer.mkdir(mode=0o700)
    new, old = (kernel_file.Compiler(12, minor, hashlib.sha256(bytes([minor])).digest()) for minor in (9, 8))
    first = write_kernel(layer, 16, "sm_90", new)
    write_kernel(layer, 32, "sm_90", new)
    write_kernel(layer, 16, "sm_80", old)
    write_kernel(layer, 32, "sm_80", kernel_file.UNRECORDED)
    data, v = first.read_bytes(), kernel_file.FORMAT_VERSION
    (layer / f"sm_90-{'0' * 32}.v{v}.cubin").write_bytes(data)
    (layer / f"sm_90-{'1' * 32}.v{v}.cubin").write_bytes(data[:-1])
    with open(layer / f"sm_90-{'2' * 32}.v{v}.cubin", "wb") as huge:
        huge.truncate(kernel_file.MAX_FILE_BYTES + 1)  # sparse: never read
    with open(os.fsencode(layer) + f"/sm_90-\xff.v{v}.cubin".encode("latin-1"), "wb") as junk:
        junk.write(b"\x7fELF" + bytes(100))
    done = run_module("info", env=cache_env(tmp_path), capture_output=True)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stdout.split(f"  {layer}\n")[1].splitlines()
    assert lines[0] == "    trusted"
    assert [line.split(", ")[0] for line in lines[1:4]] == [
        "    8 kernels",
        "    sm_80: 2 kernels",
        "    sm_90: 6 kernels",
    ]
    key = jit.kernel_key(Geometry("kv", 16).specs("sm_90")[0], "sm_90")
    assert lines[4:13] == [
        f"    built by NVRTC 12.9 sha256:{new.library.hex()[:12]}: 2 kernels",
        f"    built by NVRTC 12.8 sha256:{old.library.hex()[:12]}: 1 kernel",
        "    built by an unrecorded NVRTC: 1 kernel",
        "    4 kernels refused when read (compiled afresh at first use):",
        f"      sm_90-{'0' * 32}.v{v}.cubin: packed for sm_90, key {key[:16]}..., not the kernel its name stands for",
        f"      sm_90-{'1' * 32}.v{v}.cubin: cut or extended: no end marker",
        f"      sm_90-{'2' * 32}.v{v}.cubin: {kernel_file.MAX_FILE_BYTES + 1} bytes, over the 16 MiB cap",
        f"      sm_90-?.v{v}.cubin: cut or extended: no end marker",
        f"  {tmp_path / 'xdg' / 'nvfp4_mla'}",
    ]


def test_info_names_the_first_refused_kernels(tmp_path):
    """A layer of many refused files: the first few by name with their reasons, then a count."""
    for i in range(7):
        (tmp_path / f"sm_90-{i}.v{kernel_file.FORMAT_VERSION}.cubin").write_bytes(b"")
    assert cache_summary(tmp_path, "trusted")[-7:] == [
        "    7 kernels refused when read (compiled afresh at first use):",
        *[f"      sm_90-{i}.v{kernel_file.FORMAT_VERSION}.cubin: empty file" for i in range(5)],
        "      and 2 more",
    ]


@pytest.mark.parametrize("force_cpu", [True, False], ids=["cpu", "gpu-if-usable"])
def test_demo(capsys, tmp_path, force_cpu):
    saved = tmp_path / "demo.pt"
    assert main(["demo", "--save", str(saved)] + (["--cpu"] if force_cpu else [])) == 0
    out = capsys.readouterr().out
    if force_cpu or gpu_unavailable_reason():
        assert "Ran nvfp4_mla.reference on the CPU, not the GPU kernels: " in out
    else:
        assert "Ran the fused GPU entry" in out and "reference on the CPU: yes" in out
    assert "slot 5 = page 0, entry 5: 28 E4M3 group scales" in out and "max |quantization error|" in out
    assert len(out.splitlines()) <= 40 and "group 27" not in out  # the short demo; the record behind --full
    assert torch.load(saved, weights_only=True).shape == (2, 16, abi.RECORD_BYTES)
    assert main(["demo", "--cpu", "--full"]) == 0
    full = capsys.readouterr().out
    assert "group 27" in full and "--full" not in full


@pytest.mark.parametrize(
    "path, message",
    [("missing/dir/c.pt", "no such directory"), (".", "a directory, not a file")],
    ids=["missing dir", "a directory"],
)
def test_demo_refuses_a_bad_save_path_before_running(capsys, tmp_path, path, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--cpu", "--save", str(tmp_path / path)])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and captured.out == ""  # nothing ran
    assert captured.err.startswith("nvfp4-mla demo: error: --save ") and message in captured.err


def test_inspect_shows_the_record_demo_summarised(capsys, tmp_path):
    """demo --save FILE, then inspect FILE: inspect's default record is the one demo summarised."""
    saved = tmp_path / "demo.pt"
    assert main(["demo", "--cpu", "--save", str(saved)]) == 0
    summary = [line for line in capsys.readouterr().out.splitlines() if " E4M3 group scales " in line]
    assert len(summary) == 1 and summary[0].startswith("slot 5 = page 0, entry 5: ")
    assert main(["inspect", str(saved)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "(slot 5: the first written record; --slot N shows another)"
    assert out[1].startswith("slot 5 = page 0, entry 5 ")


def test_inspect_shows_the_first_written_record_by_default(capsys, tmp_path):
    cache = make_cache(3, 4, "HND", pad=32)
    reference.nvfp4_quantize_append_sparse_mla_cache(random_rows((1, 512)), torch.tensor([6]), cache)
    torch.save(cache, tmp_path / "c.pt")
    assert main(["inspect", str(tmp_path / "c.pt")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("(slot 6: the first written record; --slot N shows another)\nslot 6 = page 1, entry 2")
    torch.save(make_cache(2, 4), tmp_path / "empty.pt")
    with pytest.raises(SystemExit) as exit_info:
        main(["inspect", str(tmp_path / "empty.pt")])
    assert exit_info.value.code == 2 and "no record of it has been written" in capsys.readouterr().err


def test_demo_into_closed_pipe():
    """``nvfp4-mla demo | head``: the reader is gone before the first write; no traceback, the
    SIGPIPE exit status."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # no reader at all: the demo's first flush fails, deterministically
    try:
        done = run_module("demo", "--cpu", stdout=write_end, stderr=subprocess.PIPE)
    finally:
        os.close(write_end)
    for symptom in ("Traceback", "BrokenPipeError", "Exception ignored"):
        assert symptom not in done.stderr
    assert done.returncode == SIGPIPE_EXIT


def test_inspect(capsys, tmp_path):
    cache = make_cache(3, 4, "HND", pad=32)  # padded pool in HND layout: inspect must follow the strides
    row = torch.zeros(1, abi.HEAD_DIM)
    # the E2M1 known answer of docs/format.md section 4: codes 0..F in order, scale 1
    row[0, :16] = torch.tensor([0, -0.0, 0.5, -0.5, 1, -1, 1.5, -1.5, 2, -2, 3, -3, 4, -4, 6, -6])
    row[0, abi.NOPE_DIM] = 1.25
    reference.nvfp4_quantize_append_sparse_mla_cache(row.to(torch.bfloat16), torch.tensor([6]), cache)
    path = tmp_path / "cache.pt"
    torch.save(cache, path)

    assert main(["inspect", str(path), "--slot", "6"]) == 0
    out = capsys.readouterr().out
    assert "slot 6 = page 1, entry 2" in out
    assert "data row at page byte 704, scale slot at page byte 1472 (padding bytes 00 00 00 00)" in out
    assert "group  0  scale 0x38 = 1 " in out
    assert "  code      0    8    1    9    2    A    3    B    4    C    5    D    6    E    7    F" in out
    assert "  e2m1      0   -0  0.5 -0.5    1   -1  1.5 -1.5    2   -2    3   -3    4   -4    6   -6" in out
    assert "group 27  scale 0x00 = 0" in out
    assert "1.25" in out.split("RoPE")[1]
    assert "empty" not in out


def test_inspect_matches_dequantize(capsys, tmp_path, seed):
    cache = make_cache(2, 8)
    rows = random_rows((3, abi.HEAD_DIM))
    slots = torch.tensor([1, 9, 14])
    reference.cake_dsv4_nvfp4_kv_rope_quantize_insert(rows, cache, slots, torch.tensor([0, 5, 9]), rope_table(16))
    torch.save(cache, tmp_path / "c.pt")
    assert main(["inspect", str(tmp_path / "c.pt"), "--slot", "9"]) == 0
    out = capsys.readouterr().out
    values = reference.nvfp4_dequantize_sparse_mla_cache(cache, torch.tensor([9]))[0]
    scale_lines = [line for line in out.splitlines() if line.startswith("group")]
    assert len(scale_lines) == abi.NUM_GROUPS
    for g, line in enumerate(scale_lines):  # the printed max |value| is the dequantized group's
        amax = values[g * abi.GROUP_SIZE : (g + 1) * abi.GROUP_SIZE].abs().max().item()
        assert f"(max |value| {amax:g})" in line


@pytest.mark.parametrize("fill", [CANARY, 0], ids=["canary", "zeros"])
def test_format_record_empty(fill, seed):
    cache = make_cache(2, 4).fill_(fill)
    written = 5
    reference.nvfp4_quantize_append_sparse_mla_cache(random_rows((1, abi.HEAD_DIM)), torch.tensor([written]), cache)
    text = format_record(cache, 2)
    assert text.splitlines()[0].startswith("slot 2 = page 0, entry 2")
    assert len(text.splitlines()) == 2
    assert f"empty record: all 384 bytes are 0x{fill:02X}" in text
    assert ("a written row of 512 zeros" in text) == (fill == 0)
    assert "empty" not in format_record(cache, written)  # a written slot of the same cache prints in full
    assert "group 27" in format_record(cache, written)


def test_format_record_zero_row_written():
    """A written row of zeros is 384 zero bytes: inspect cannot tell it from an unwritten zero
    slot, and says so instead of calling it never written."""
    cache = make_cache(1, 4)
    reference.nvfp4_quantize_append_sparse_mla_cache(
        torch.zeros(1, abi.HEAD_DIM, dtype=torch.bfloat16), torch.tensor([1]), cache
    )
    assert "0x00 (never written, or a written row of 512 zeros)" in format_record(cache, 1)
    assert "0xA5 (never written)" in format_record(cache, 0)


def _bad_inputs(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """name -> (path, expected message) of files inspect refuses."""
    (tmp_path / "text.pt").write_text("not a tensor\n")
    torch.save({"cache": 1}, tmp_path / "dict.pt")
    torch.save(make_cache(1, 4), tmp_path / "cache.pt")
    return {
        "missing": (str(tmp_path / "missing.pt"), "missing.pt: no such file"),
        "directory": (str(tmp_path), "cannot read it"),
        "text": (str(tmp_path / "text.pt"), "not a tensor saved with torch.save"),
        "dict": (str(tmp_path / "dict.pt"), "holds a dict, not a cache tensor"),
        "slot": (str(tmp_path / "cache.pt"), "slot 4 is outside the cache's 4 slots"),
    }


@pytest.mark.parametrize("case", ["missing", "directory", "text", "dict", "slot"])
def test_inspect_bad_input(capsys, tmp_path, case):
    path, message = _bad_inputs(tmp_path)[case]
    with pytest.raises(SystemExit) as exit_info:
        main(["inspect", path, "--slot", "4"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("nvfp4-mla inspect: error: ") and message in err
    assert err.count("\n") == 1  # one line, no traceback


def test_inspect_missing_file_subprocess(tmp_path):
    done = run_module("inspect", str(tmp_path / "missing.pt"), capture_output=True)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1] == f"nvfp4-mla inspect: error: {tmp_path / 'missing.pt'}: no such file"


PRECOMPILE_ARGV = [
    "precompile", "--heads", "8", "--q-head-padded", "16", "--page-size", "64", "--kv-ratio", "1", "2",
    "--append", "--slot-dtype", "int32", "--arch", "sm_80", "sm_90",
]  # fmt: skip


def test_precompile(capsys, tmp_path):
    target = tmp_path / "image-kernels"
    argv = [*PRECOMPILE_ARGV, "--cache-dir", str(target)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    # stderr is not a terminal here: one plain line per kernel, no carriage returns
    assert "\r" not in captured.err
    assert captured.err.splitlines()[-1] == "[8/8] sm_90: append, page 64, int32 slots"
    assert captured.out.splitlines()[-1] == f"8 kernels ready in {target}"
    cubins = sorted(target.glob("*.cubin"))
    assert len(cubins) == 8 and {p.name.split("-")[0] for p in cubins} == {"sm_80", "sm_90"}
    assert sorted(captured.out.splitlines()[:-1]) == [str(p) for p in cubins]

    assert main(argv) == 0  # already there: same files, nothing new
    assert sorted(target.glob("*.cubin")) == cubins
    info = run_module("info", env={"NVFP4_MLA_CACHE_DIR": str(target)}, capture_output=True)
    assert "sm_80: 4 kernels" in info.stdout and "    trusted" in info.stdout


def test_precompile_counts_unique_kernels(tmp_path):
    """The main entry without q_out (q_head_padded 0) is the KV entry with ratio 1: one kernel,
    compiled into the kernel cache's first layer; stderr (a pipe) gets one plain line."""
    argv = ["precompile", "--heads", "8", "--kv-ratio", "1", "--page-size", "16", "--arch", "sm_90"]
    done = run_module(*argv, env=cache_env(tmp_path), capture_output=True)
    assert done.returncode == 0, done.stderr
    cubins = list((tmp_path / "kernels").glob("*.cubin"))
    assert len(cubins) == 1
    assert done.stdout.splitlines() == [str(cubins[0]), f"1 kernel ready in {tmp_path / 'kernels'}"]
    assert "\r" not in done.stderr
    progress = [line for line in done.stderr.splitlines() if line.startswith("[")]
    assert progress == ["[1/1] sm_90: main, page 16, 8 heads, cache only (the KV kernel, ratio 1), int64 slots"]


def test_precompile_reader_and_decode_kernels(tmp_path):
    """--read builds the reader for both output dtypes, --decode every kernel of sparse_mla_decode
    for the arch (three mma.sync head tiles, the wgmma kernel built for sm_90a alone and in clusters,
    with whole and half rows, and its NARROW build, the split combine prefetching 4 and 16 splits,
    and whatever else the registry lists for decode); the progress has a line per kernel."""
    argv = ["precompile", "--page-size", "16", "--read", "--decode", "--arch", "sm_90", "--cache-dir", str(tmp_path)]
    done = run_module(*argv, env=cache_env(tmp_path / "unused"), capture_output=True)
    assert done.returncode == 0, done.stderr
    kernels = 2 + len(Geometry("decode").specs("sm_90"))
    assert done.stdout.splitlines()[-1] == f"{kernels} kernels ready in {tmp_path}"
    assert len(list(tmp_path.glob("*.cubin"))) == kernels and len(list(tmp_path.glob("sm_90a-*.cubin"))) == 5
    progress = [line for line in done.stderr.splitlines() if line.startswith("[")]
    assert len(progress) == kernels and progress[-1].startswith(f"[{kernels}/{kernels}] sm_90: ")
    assert list(tmp_path.glob("*.lock")) == []  # an image directory holds kernels only


def test_precompile_cache_dir_unusable(capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exit_info:
        main(["precompile", "--kv-ratio", "1", "--arch", "sm_90", "--cache-dir", str(blocker / "kernels")])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and "[1/" not in captured.err  # before any work
    assert captured.err.splitlines()[-1].startswith("nvfp4-mla precompile: error: --cache-dir: cannot write kernels")
    assert str(blocker / "kernels") in captured.err


def test_precompile_without_writable_cache(tmp_path):
    """Kernels compiled in memory only are lost when precompile exits: that is an error."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {"NVFP4_MLA_CACHE_DIR": str(blocker / "kernels"), "XDG_CACHE_HOME": str(blocker / "xdg")}
    done = run_module("precompile", "--kv-ratio", "1", "--arch", "sm_90", env=env, capture_output=True)
    assert done.returncode == 1
    assert "no writable kernel cache directory, so the kernels stayed in memory" in done.stderr
    assert done.stdout == ""


def test_precompile_progress_counts_kernels(capsys, monkeypatch, tmp_path):
    """One progress line per kernel, not per request: --decode is several kernels, each named."""
    built = []

    def build(self, spec, arch, directory=None, skip=()):  # a compile-free stand-in
        built.append(spec)
        return b"", directory / f"{arch}-{len(built)}.cubin"

    monkeypatch.setattr(kernel_cache.KernelCache, "build", build)
    argv = ["precompile", "--page-size", "16", "--read", "--decode", "--arch", "sm_90", "--cache-dir", str(tmp_path)]
    assert main(argv) == 0
    decode_specs = Geometry("decode").specs("sm_90")
    kernels = 2 + len(decode_specs)
    assert len(built) == kernels
    captured = capsys.readouterr()
    assert captured.out.splitlines()[-1] == f"{kernels} kernels ready in {tmp_path}"
    assert captured.err.splitlines() == [
        f"[1/{kernels}] sm_90: read, page 16, int64 slots -> float32",
        f"[2/{kernels}] sm_90: read, page 16, int64 slots -> bfloat16",
        *(f"[{i}/{kernels}] sm_90: {spec.describe()}" for i, spec in enumerate(decode_specs, 3)),
    ]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_precompile_progress_bar_on_terminal(capsys, monkeypatch, tmp_path):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    argv = ["precompile", "--kv-ratio", "1", "2", "--page-size", "16", "--arch", "sm_90", "--cache-dir", str(tmp_path)]
    assert main(argv) == 0
    bar = terminal.getvalue()
    assert "\r" in bar and "2/2" in bar  # tqdm redraws its line in place
    assert "[1/2]" not in bar  # not the plain lines of a log
    assert "2 kernels ready" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--heads", "8", "--q-head-padded", "16", "--inplace", "--arch", "sm_90"], "q_inplace needs"),
        (["--arch", "sm_90"], "nothing to build"),
        (["--q-head-padded", "16", "--arch", "sm_90"], "give --heads too"),
        (["--heads", "8", "--page-size", "0", "--arch", "sm_90"], "--page-size must be positive"),
        (["--heads", "8", "--arch", "sm_75"], "older than sm_80"),
        (["--heads", "8", "--arch", "hopper"], "arch must look like 'sm_90'"),
    ],
    ids=["inplace-and-padded", "nothing", "padded-without-heads", "page-size-0", "old-arch", "bad-arch"],
)
def test_precompile_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["precompile", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(gpu_unavailable_reason() is None, reason="checks the message given without a usable GPU")
def test_precompile_needs_arch_without_gpu(capsys, monkeypatch):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)  # else its architectures are the default
    with pytest.raises(SystemExit):
        main(["precompile", "--heads", "8"])
    assert "give --arch" in capsys.readouterr().err


def test_bench_is_forwarded(monkeypatch):
    seen = []
    fake = types.ModuleType("nvfp4_mla.bench")
    fake.main = lambda argv: seen.append(argv) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "nvfp4_mla.bench", fake)
    monkeypatch.setattr(nvfp4_mla, "bench", fake, raising=False)
    assert main(["bench", "--quick", "--help"]) == 0
    assert seen == [["--quick", "--help"]]


def test_bench_help_names_the_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "-h"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: nvfp4-mla bench")
