"""Measurements outside the grid: first use in fresh processes, and the run's environment."""

from __future__ import annotations

import importlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import nvfp4_mla

from .. import jit, ops
from ..device import device_info
from ..ops import writers
from ..testing import rope_table
from .arms import fused_call
from .grid import MAX_POSITION, Row
from .inputs import make_inputs
from .results import FirstUse, reason

PROBE_ROW = Row.main(1, 8, 16)
PROBE_TIMEOUT_S = 240


def first_call_probe(mode: str) -> dict[str, float]:
    """Runs inside a fresh process (``--first-call-probe``): times its first fused call, and with
    ``mode == "cold"`` also ``jit.compile_kernel`` of the same geometry afterwards."""
    device = torch.device("cuda", torch.cuda.current_device())
    inputs = make_inputs(PROBE_ROW, device)  # also creates the CUDA context
    call = fused_call(PROBE_ROW, ops, rope_table(MAX_POSITION, device))
    began = time.perf_counter()
    importlib.import_module("cupy")  # timed apart: once per process, whatever the geometry
    report = {"import_cupy_s": time.perf_counter() - began}
    torch.cuda.synchronize()
    began = time.perf_counter()
    call(inputs)
    torch.cuda.synchronize()
    report["first_call_s"] = time.perf_counter() - began
    if mode == "cold":
        row = PROBE_ROW
        spec = writers.main_spec(row.page_size, row.slot_dtype, row.num_heads, row.q_head_padded, True, False)
        began = time.perf_counter()
        jit.compile_kernel(spec, device_info(device.index).arch)
        report["compile_kernel_s"] = time.perf_counter() - began
    return report


def _run_probe(mode: str, cache_dir: str) -> dict[str, Any]:
    package_root = str(Path(nvfp4_mla.__file__).resolve().parents[1])
    # The new directory is the only cache the probe sees: the per-user default lives under it too.
    env = dict(os.environ, NVFP4_MLA_CACHE_DIR=cache_dir, XDG_CACHE_HOME=cache_dir)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", "nvfp4_mla.bench", "--first-call-probe", mode]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{mode} probe exited with {proc.returncode}: {tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_first_use() -> FirstUse:
    """Two fresh processes sharing a new disk cache: the first compiles, the second reloads."""
    try:
        with tempfile.TemporaryDirectory(prefix="nvfp4_mla-bench-") as cache_dir:
            cold = _run_probe("cold", cache_dir)
            warm = _run_probe("warm", cache_dir)
        return FirstUse(
            cold["first_call_s"],
            cold.get("compile_kernel_s"),
            warm["first_call_s"],
            statistics.median([cold["import_cupy_s"], warm["import_cupy_s"]]),
        )
    except Exception as exc:
        return FirstUse(error=reason(exc))


def gpu_slug(name: str) -> str:
    """A directory name for a GPU: ``"NVIDIA H200"`` -> ``"nvidia-h200"``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def nvidia_smi(device: torch.device) -> str:
    """Clocks, power limit, temperature and driver of the device, or why they are unknown."""
    fields = "driver_version,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,power.limit,temperature.gpu"
    query = ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"]
    commands = [query]  # one line per GPU: the first is taken
    try:
        from cupy.cuda import runtime

        commands.insert(0, [*query, "-i", runtime.deviceGetPCIBusId(device.index)])  # this GPU only
    except Exception:  # no CuPy: the first GPU's line
        pass
    failure = "nvidia-smi not available"
    for command in commands:
        try:
            out = subprocess.run(command, capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"nvidia-smi not available ({type(exc).__name__})"
        if out.returncode == 0 and out.stdout.strip():
            values = [v.strip() for v in out.stdout.strip().splitlines()[0].split(",")]
            driver, sm, sm_max, mem, mem_max, power, temperature = ([*values, *[""] * 7])[:7]
            return (
                f"SM {sm} (max {sm_max}), memory {mem} (max {mem_max}), power limit {power}, "
                f"{temperature} C, driver {driver} (sampled after the run)"
            )
        failure = f"nvidia-smi failed: {(out.stderr or out.stdout).strip()[:120]}"
    return failure


def git_commit(directory: Path | None = None) -> str:
    """The short commit of the checkout the package runs from (or ``directory``), marked when its
    tracked files differ from that commit (a run of an uncommitted tree); or why there is none."""
    here = str(directory or Path(__file__).parent)
    try:
        head = subprocess.run(
            ["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        if not head:
            return "not a git checkout"
        changed = subprocess.run(
            ["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return f"{head} with uncommitted changes" if changed else head
    except (OSError, subprocess.TimeoutExpired):
        return "git not available"


def environment(device: torch.device) -> list[tuple[str, str]]:
    """(name, value) lines: GPU, torch, CuPy, NVRTC, driver, clocks, package, Python."""
    props = torch.cuda.get_device_properties(device)
    l2 = getattr(props, "L2_cache_size", 0)
    env = [
        (
            "GPU",
            f"{props.name} (sm_{props.major}{props.minor}, {props.multi_processor_count} SMs, "
            f"{props.total_memory / 2**30:.0f} GiB, L2 {l2 / 2**20:.0f} MiB)",
        ),
        ("torch", f"{torch.__version__} (CUDA {torch.version.cuda})"),
    ]
    try:
        import cupy
        from cupy.cuda import nvrtc, runtime

        driver = runtime.driverGetVersion()
        env += [
            ("CuPy", cupy.__version__),
            ("NVRTC", "{}.{}".format(*nvrtc.getVersion())),
            ("CUDA driver API", f"{driver // 1000}.{driver % 1000 // 10}"),
        ]
    except Exception as exc:
        env.append(("CuPy", f"not available ({reason(exc)})"))
    env += [
        ("clocks (nvidia-smi)", nvidia_smi(device)),
        ("nvfp4_mla", f"{nvfp4_mla.__version__} (commit {git_commit()})"),
        ("Python", f"{platform.python_version()} on {platform.machine()}"),
    ]
    return env
