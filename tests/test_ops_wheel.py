"""The built wheel carries every kernel source: installed from it, the package compiles the decode
kernel whose source includes the most headers from its own copy of kernels/."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from nvfp4_mla import jit

ROOT = Path(__file__).resolve().parents[1]

# Run from the unpacked wheel: the Hopper decode kernel in clusters, built for sm_90a.
CHECK = """
import sys
from pathlib import Path
from nvfp4_mla import jit
from nvfp4_mla.ops import decode_sm90
assert jit.kernel_dir() == Path(sys.argv[1]) / "nvfp4_mla" / "kernels", jit.kernel_dir()
spec = decode_sm90.WgmmaAttentionSpec.of(2)
assert len(spec.template.headers) > 8, spec.template.headers
result = jit.compile_kernel(spec, "sm_90a")
assert result.cubin[:4] == b"\\x7fELF"
print("compiled", len(spec.template.headers), "headers")
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)]
    subprocess.run(build, check=True, capture_output=True, cwd=out)
    (found,) = out.glob("nvfp4_mla-*.whl")
    return found


def test_the_wheel_holds_every_kernel_file(wheel):
    with zipfile.ZipFile(wheel) as archive:
        shipped = {Path(name).name for name in archive.namelist() if name.startswith("nvfp4_mla/kernels/")}
    sources = {p.name for p in (ROOT / "kernels").iterdir() if p.suffix in (".cu", ".cuh")}
    assert sources <= shipped


def test_the_installed_package_compiles_a_decode_kernel(wheel, tmp_path):
    pytest.importorskip("cupy", reason="CuPy is needed for NVRTC (pip install 'nvfp4-mla[cu12]')")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", CHECK, str(site)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "compiled" in done.stdout
    assert jit.kernel_dir() == ROOT / "kernels"  # this process still runs the source tree
