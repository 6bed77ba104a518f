"""The no-quantizer arm's kernels: the shipped writer with the quantizer's functions stubbed.

Built mechanically from the shipped source: :func:`stub_header` replaces the body of each
function named in :data:`STUBS` (found by name in ``kernels/nvfp4_numerics.cuh``) with a few bit
operations on its inputs, keeping its signature, so the stub kernel's loads and stores are the
real kernel's. No bench-only branch ships in the kernel. The stub kernels compile through
``jit.compile_kernel`` with that header (so their key differs from the shipped kernels') and stay
in memory (:class:`StubKernelCache`). :func:`kernel_library` gives the writer entries (same
validation, same launch geometry) on them, or on the shipped kernels with another number of KV
rows a warp (the A/B), through a :class:`nvfp4_mla.KernelLibrary` of their own.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import nvfp4_mla

from .. import jit, ops
from ..ops.writer_spec import WriterSpec
from ..testing.kernels import MemoryKernels
from .arms import Entries, Library
from .grid import SHIPPED_KV_ROWS_PER_WARP

# The quantizer: function name -> its stub body, given the definition's parameter names. Each
# stub still depends on every input, so the compiler keeps the loads that feed it.
STUBS: dict[str, Callable[..., str]] = {
    "group_amax": lambda h0, h1: (
        f"const float amax = __uint_as_float({h0}.x ^ {h0}.y ^ {h0}.z ^ {h0}.w ^ {h1}.x ^ {h1}.y ^ {h1}.z ^ {h1}.w);\n"
        "    return {make_float2(amax, amax), false};"
    ),
    "scale_code": lambda amax: f"return __float_as_uint({amax}) >> 25;",  # 7 bits, as an E4M3 code of amax >= 0
    "group_codes": lambda h0, h1, a, code0, code1: (
        f"return make_uint2({h0}.x ^ {h0}.y ^ {h0}.z ^ {h0}.w ^ __float_as_uint({a}.amax.x) ^ {code0},\n"
        f"                      {h1}.x ^ {h1}.y ^ {h1}.z ^ {h1}.w ^ __float_as_uint({a}.amax.y) ^ {code1});"
    ),
}

# What brace counting must skip: comments, string and character literals; and the braces.
_TOKENS = re.compile(r"//[^\n]*|/\*.*?\*/|\"(?:\\.|[^\"\\])*\"|'(?:\\.|[^'\\])*'|[{}]", re.DOTALL)


def _body_end(text: str, start: int) -> int:
    """The index just past the brace that closes the one at ``start``."""
    depth = 0
    for token in _TOKENS.finditer(text, start):
        if token.group() in "{}":
            depth += 1 if token.group() == "{" else -1
            if depth == 0:
                return token.end()
    raise ValueError(f"unbalanced braces after offset {start} of {jit.NUMERICS_HEADER}")


def definition(header: str, name: str) -> tuple[list[str], int, int]:
    """The parameter names of ``__device__`` function ``name``'s definition in ``header`` and the
    span of its body, braces included; ValueError unless it is defined exactly once."""
    pattern = rf"^[ \t]*__device__\b[^;{{}}]*?\b{re.escape(name)}\s*\(([^()]*)\)\s*\{{"
    found = list(re.finditer(pattern, header, re.MULTILINE))
    if len(found) != 1:
        raise ValueError(
            f"the quantizer function {name} is defined {len(found)} times in {jit.NUMERICS_HEADER}; "
            "the no-quantizer arm stubs exactly one definition of each of " + ", ".join(STUBS)
        )
    match = found[0]
    params = [re.findall(r"\w+", p)[-1] for p in match.group(1).split(",") if p.strip()]
    start = match.end() - 1
    return params, start, _body_end(header, start)


def stub_header(header: str) -> str:
    """``header`` with the body of every function in :data:`STUBS` replaced by its stub."""
    for name, stub in STUBS.items():
        params, start, end = definition(header, name)
        try:
            body = stub(*params)
        except TypeError:
            raise ValueError(f"{name} takes parameters {params} in {jit.NUMERICS_HEADER}; its stub does not") from None
        header = header[:start] + "{\n    " + body + "\n}" + header[end:]
    return header


def shipped_header() -> str:
    """The text of the shipped ``kernels/nvfp4_numerics.cuh``."""
    return jit.source(jit.NUMERICS_HEADER)


class StubKernelCache(MemoryKernels):
    """Kernels compiled with another numerics header, in memory only; their keys (which hash the
    header) are not the shipped kernels'."""

    what = "stub kernels"

    def __init__(self, header: str):
        super().__init__()
        self.header = header

    def compile(self, spec: jit.KernelSpec, arch: str) -> bytes:
        return jit.compile_kernel(spec, arch, sources={jit.NUMERICS_HEADER: self.header}).cubin


@functools.cache
def stub_kernel_cache() -> StubKernelCache:
    """The process's cache of stub kernels (:func:`stub_header` of the shipped header)."""
    return StubKernelCache(stub_header(shipped_header()))


@functools.cache
def kernel_library(kv_rows_per_warp: int, stubbed: bool) -> Library:
    """The writer entries on the kernels with ``kv_rows_per_warp`` KV rows a warp, with the
    quantizer stubbed or not (``nvfp4_mla.ops`` itself for the shipped kernels): each entry
    bound to a :class:`nvfp4_mla.KernelLibrary` of these kernels, with plan tables of its own."""
    if not stubbed and kv_rows_per_warp == SHIPPED_KV_ROWS_PER_WARP:
        return ops

    def tune(spec: object) -> object:
        return spec._replace(kv_rows_per_warp=kv_rows_per_warp) if isinstance(spec, WriterSpec) else spec

    library = nvfp4_mla.KernelLibrary(stub_kernel_cache() if stubbed else None, tune=tune)
    return Entries(*(functools.partial(getattr(ops, name), library=library) for name in Entries._fields))
