"""An entry made from one description (:class:`Entry`): its torch custom ops with their fakes, the
dispatch of an eager call, and what the registry (:mod:`.registry`) lists of it.

The public function stays written out (typed, documented): under torch.compile it calls one of the
ops, otherwise the dispatch. The dispatch sends a call with a CUDA tensor among the arguments it
routes on to the kernel path, ``kernel(library or DEFAULT, *arguments)``, and a call with none to
the entry of the same name in :mod:`nvfp4_mla.reference` (a call that mixes CUDA and CPU tensors
is then refused by the kernel path's checks: ``must be a CUDA tensor``). The ops, when they run,
call the dispatch on the default library.

The kernel path, the reference and the ops take the entry's arguments in one order: the kernel
path's parameters after the library. The ops take the leading ones and fix the rest
(:attr:`Op.fixed`); :func:`make` checks the names against the kernel path and the reference.
"""

from __future__ import annotations

import inspect
import linecache
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar

import torch
from torch._ops import OpOverload

from .. import reference
from ..jit import KernelSpec
from .library import DEFAULT

NAMESPACE = "nvfp4_mla"
R = TypeVar("R")


class Op(NamedTuple):
    """One custom op of an entry: ``torch.ops.nvfp4_mla.<name>``."""

    name: str
    returns: str = "()"  # the schema's return type; "()": the op only writes its mutated arguments
    mutates: tuple[str, ...] = ()  # the arguments it writes
    extra: str = ""  # its arguments after the entry's shared ones, in schema syntax ("Tensor out")
    fixed: tuple = ()  # the values it gives the entry's remaining arguments (q_inplace=True)
    # Its output from its arguments, passed by name: it names those it reads and takes the rest
    # as ``**_``. None for an op that returns nothing.
    fake: Callable[..., Any] | None = None


class Request(NamedTuple):
    """The entry in the registry: what a precompile request of it builds, and what CI compiles."""

    name: str  # Geometry.entry
    # The kernels of a request on an arch, called with ``arch`` and the request's fields by name
    # (Geometry's fields are the entries' arguments); ValueError for what the entry would refuse.
    kernels: Callable[..., tuple[KernelSpec, ...]]
    catalogue: Callable[[str], Iterable[KernelSpec]]  # the builds CI compiles for an arch
    note: str = ""  # after the entry's name in help texts and ``nvfp4-mla info``


@dataclass(frozen=True)
class Entry(Generic[R]):
    """One public entry, described once."""

    name: str  # the public function's, and its reference's in nvfp4_mla.reference
    args: str  # the arguments its ops share, in schema syntax ("Tensor q, SymInt q_head_padded")
    ops: tuple[Op, ...]
    kernel: Callable[..., R]  # the kernel path: (library, *the entry's arguments)
    request: Request
    routes_on: tuple[str, ...] = ()  # the arguments whose device picks the path; (): every tensor of args

    @property
    def summary(self) -> str:
        """The entry in words, for help texts and ``nvfp4-mla info``."""
        return f"{self.name} ({self.request.note})" if self.request.note else self.name


# torch holds custom ops weakly: these keep them registered.
_DEFINED: list[object] = []


def make(entry: Entry[R]) -> tuple[Callable[..., R], tuple[OpOverload, ...]]:
    """Registers the entry's custom ops and their fakes; returns the eager dispatch, called as
    ``dispatch(library, *the entry's arguments)``, and the ops, in the order of ``entry.ops``."""
    names = list(inspect.signature(entry.kernel).parameters)[1:]
    dispatch = eager_dispatch(entry, names)
    shared = _arguments(entry.args)
    ops = []
    for op in entry.ops:
        arguments = shared + _arguments(op.extra)
        op_names = [n for _, n in arguments]
        if names[: len(op_names)] != op_names or len(op_names) + len(op.fixed) != len(names):
            raise TypeError(f"{NAMESPACE}::{op.name} takes {op_names} and fixes {op.fixed}: the entry has {names}")
        if (op.fake is None) != (op.returns == "()"):
            raise TypeError(f"{NAMESPACE}::{op.name}: an op that returns something has a fake, and only it")
        schema = ", ".join(_annotated(t, n, i, n in op.mutates) for i, (t, n) in enumerate(arguments))
        defined = torch.library.custom_op(
            f"{NAMESPACE}::{op.name}",
            _run(dispatch, op.fixed, op.returns == "()"),
            mutates_args=op.mutates,
            schema=f"({schema}) -> {op.returns}",
        )
        defined.register_fake(_fake(op.fake, op_names))
        _DEFINED.append(defined)
        ops.append(getattr(getattr(torch.ops, NAMESPACE), op.name).default)
    return dispatch, tuple(ops)


def _arguments(text: str) -> list[tuple[str, str]]:
    """(type, name) of each argument of a schema's argument list."""
    found = []
    for argument in text.split(","):
        if argument.strip():
            kind, name = argument.split()
            found.append((kind, name))
    return found


def _annotated(kind: str, name: str, index: int, written: bool) -> str:
    """An argument in schema syntax; a written tensor gets its alias set, named as torch names it."""
    if written:
        kind = kind.replace("Tensor", f"Tensor(a{index}!)", 1)
    return f"{kind} {name}"


def eager_dispatch(entry: Entry[R], names: list[str]) -> Callable[..., R]:
    """The eager dispatch of the entry's arguments ``names``, compiled with them as its own
    parameters: forwarding ``*args`` would cost more host time than the device test itself."""
    parameters = inspect.signature(getattr(reference, entry.name)).parameters
    if list(parameters) != names:
        raise TypeError(f"reference.{entry.name} takes {list(parameters)}: the kernel path {names}")
    if {"library", "kernel", "reference", "Tensor", "DEFAULT"} & {*names}:
        raise TypeError(f"{entry.name}: an argument name is one the dispatch uses itself")
    keyword = {n for n, p in parameters.items() if p.kind is p.KEYWORD_ONLY}
    listed = ", ".join(names)
    routes_on = entry.routes_on or [n for t, n in _arguments(entry.args) if t.startswith("Tensor")]
    cuda = " or ".join(f"(isinstance({n}, Tensor) and {n}.is_cuda)" for n in routes_on)
    # The reference is looked up on each call, so that tests can stand in for it.
    source = (
        f"def {entry.name}(library, {listed}):\n"
        f"    if {cuda}:\n"
        f"        return kernel(DEFAULT if library is None else library, {listed})\n"
        f"    return reference.{entry.name}({', '.join(f'{n}={n}' if n in keyword else n for n in names)})\n"
    )
    filename = f"<{NAMESPACE} dispatch of {entry.name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # for tracebacks
    scope: dict[str, Any] = {"__name__": __name__, "Tensor": torch.Tensor, "DEFAULT": DEFAULT}
    scope.update(kernel=entry.kernel, reference=reference)
    exec(compile(source, filename, "exec"), scope)
    dispatch: Callable[..., R] = scope[entry.name]
    return dispatch


def _run(dispatch: Callable[..., Any], fixed: tuple, returns_nothing: bool) -> Callable[..., Any]:
    """What an op runs: the dispatch on the default library (the op is not being traced then)."""

    def run(*args: Any) -> Any:
        result = dispatch(None, *args, *fixed)
        return None if returns_nothing else result

    return run


def _fake(fake: Callable[..., Any] | None, names: list[str]) -> Callable[..., Any]:
    def by_name(*args: Any) -> Any:
        return None if fake is None else fake(**dict(zip(names, args)))

    return by_name
