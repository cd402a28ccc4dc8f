"""Backends and how one is chosen.

A backend is a module that implements the ops of :mod:`normlab.reference` with the same
signatures (``layer_norm``, ``rms_norm``, ``add_layer_norm``, ``add_rms_norm``), already
validated by :mod:`normlab.functional`:

- ``reference``: :mod:`normlab.reference`, plain torch, any device, autograd for the backward.
- ``cpu``: fused numba kernels for CPU tensors (``normlab.kernels.cpu``).
- ``triton``: fused Triton kernels for CUDA tensors (``normlab.kernels.triton``); with
  ``TRITON_INTERPRET=1`` they also run on CPU tensors, slowly (for tests).

Choice, first that applies: the ``backend=`` argument, then :func:`use_backend` (a context
manager), then the ``NORMLAB_BACKEND`` environment variable, then ``"auto"``, which takes the
fused backend for the tensor's device when it is available and the reference otherwise.
Sequence BatchNorm has only the reference implementation.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import os
from collections.abc import Iterator
from types import ModuleType

import torch

from normlab import reference

BACKENDS = ("reference", "cpu", "triton")
CHOICES = ("auto",) + BACKENDS

_MODULES = {
    "reference": "normlab.reference",
    "cpu": "normlab.kernels.cpu",
    "triton": "normlab.kernels.triton",
}

_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("normlab_backend", default=None)


def check_name(name: str, what: str = "backend") -> str:
    if name not in CHOICES:
        raise ValueError(f"{what} must be one of {', '.join(map(repr, CHOICES))}; got {name!r}")
    return name


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Use backend ``name`` for every normlab op in this block (unless an op names its own).

    >>> with normlab.use_backend("reference"):
    ...     y = normlab.rms_norm(x, w)
    """
    token = _override.set(check_name(name))
    try:
        yield
    finally:
        _override.reset(token)


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_loaded: dict[str, ModuleType] = {"reference": reference}  # backend name -> its imported module


# The oldest versions the fused kernels are tested with (the cpu kernels emit LLVM IR that needs
# the LLVM of numba 0.68's llvmlite: bfloat vectors, opaque-pointer intrinsic names; Triton
# before 3.9 rejects some of the triton kernels' options, e.g. "Cannot bitcast data-type of size 64").
MIN_VERSIONS = {"numba": (0, 68), "triton": (3, 9)}


def _too_old(package: str, version: str) -> str | None:
    """Why ``version`` of ``package`` cannot run the fused kernels, or None."""
    need = MIN_VERSIONS.get(package)
    parts = [int(p) for p in version.split(".")[:2] if p.isdigit()]
    if need is None or tuple(parts) >= need:
        return None
    want = ".".join(map(str, need))
    return (f"{package} {version} is older than the {want} the kernels need; "
            f"pip install -U '{package}>={want}'")


@functools.cache
def _import_reason(name: str) -> str | None:
    """Why backend ``name`` cannot be imported on this machine, or None when it can."""
    if name == "reference":
        return None
    needs = {"cpu": "numba", "triton": "triton"}[name]
    try:
        module = importlib.import_module(needs)
    except ImportError as err:
        return f"{needs} is not installed ({err}); pip install {needs}"
    old = _too_old(needs, getattr(module, "__version__", "0"))
    if old:
        return old
    try:
        _loaded[name] = importlib.import_module(_MODULES[name])
    except ModuleNotFoundError as err:
        if err.name == _MODULES[name]:
            return "this version of normlab has no fused kernels for it yet"
        raise
    return None


def unavailable_reason(name: str) -> str | None:
    """Why backend ``name`` cannot run on this machine, or None when it can."""
    check_name(name)
    if name == "auto":
        return None
    reason = _import_reason(name)
    if reason is None and name == "triton" and not (torch.cuda.is_available() or _interpret()):
        reason = "no CUDA device (set TRITON_INTERPRET=1 to run the kernels on CPU, slowly)"
    return reason


def available_backends() -> list[str]:
    return [name for name in BACKENDS if unavailable_reason(name) is None]


def _device_reason(name: str, device: torch.device) -> str | None:
    if name == "cpu" and device.type != "cpu":
        return f"the cpu backend runs on CPU tensors; got a tensor on {device}"
    if name == "triton" and device.type != "cuda" and not (device.type == "cpu" and _interpret()):
        return f"the triton backend runs on CUDA tensors (or CPU ones under TRITON_INTERPRET=1); got {device}"
    return None


def resolve(backend: str | None, device: torch.device) -> str:
    """The name of the backend that will run an op on ``device``."""
    return _resolve(backend, device.type, device.index)


def for_tensor(backend: str | None, x: torch.Tensor) -> ModuleType:
    """The backend module that runs an op on ``x``: :func:`resolve` for x's device, without making
    a torch.device for a CPU tensor (a cost every small call would pay)."""
    if x.is_cpu:
        return _loaded[_resolve(backend, "cpu", None)]
    device = x.device
    return _loaded[_resolve(backend, device.type, device.index)]


_ENVIRON_TYPE = type(os.environ)
_ENV_KEY = os.environ.encodekey("NORMLAB_BACKEND")


def _env_backend() -> str | None:
    """NORMLAB_BACKEND, read at every call (a notebook or a test may set it at run time). Where
    it is unset, ``os.environ.get`` raises and catches a KeyError: 5 us of a 60 us call inside a
    model (docs/cpu-kernels.md, "Fixed costs of a call"); os.environ's own dict answers without."""
    env = os.environ
    if type(env) is _ENVIRON_TYPE:
        value = env._data.get(_ENV_KEY)
        return None if value is None else env.decodevalue(value)
    return env.get("NORMLAB_BACKEND")  # os.environ replaced by a plain mapping (a test's monkeypatch)


def _resolve(backend: str | None, device_type: str, device_index: int | None) -> str:
    name = backend or _override.get() or _env_backend() or "auto"
    if name not in CHOICES:
        check_name(name)  # raises
    # TRITON_INTERPRET changes only what "triton" means (auto picks triton only for a CUDA tensor,
    # where it is moot): read it for that name alone, as each read is a few Python calls
    return _choose(name, device_type, device_index, name == "triton" and _interpret())


@functools.cache
def _choose(name: str, device_type: str, device_index: int | None, interpret: bool) -> str:
    """_resolve's answer once the name is known: the same for every call on a device (``interpret``,
    TRITON_INTERPRET's setting, is part of the key), and a tenth of a small call's time to work out."""
    device = torch.device(device_type,
                          device_index) if device_index is not None else torch.device(device_type)
    if name == "auto":
        fused = {"cpu": "cpu", "cuda": "triton"}.get(device.type)
        if fused and unavailable_reason(fused) is None and _device_reason(fused, device) is None:
            return fused
        return "reference"
    reason = unavailable_reason(name) or _device_reason(name, device)
    if reason is not None:
        raise RuntimeError(f"normlab backend {name!r} cannot run here: {reason}")
    return name


# Under torch.compile the choice is made once, when the model is traced, and baked into the
# graph (dynamo cannot trace a ContextVar): recompile to switch backends in a compiled model.
# This is what torch.compiler.assume_constant_result(_resolve) does; calling that here would
# import torch._dynamo with normlab and add a second to every `import normlab`. The compile
# tests (fullgraph=True) fail loudly if torch ever renames the mark.
_resolve._dynamo_marked_constant = True  # type: ignore[attr-defined]


def get(name: str) -> ModuleType:
    """The module of a backend that :func:`resolve` returned (so it is imported already)."""
    return _loaded[name]
