"""numba's on-disk cache for this package, keyed by the hash of all its kernel sources.

numba keys a cached function by the file that defines it, but a kernel here inlines helpers
from other files (codecs.py, simd.py, rows.py): after an edit to a helper, the kernel's file is
unchanged and numba would load the stale machine code. So every kernel is cached in a directory
named by the hash of every file in SOURCES, and stamped with it: any edit there recompiles them
all, and two versions of the package (two checkouts, an A/B run) keep separate caches.
"""

from __future__ import annotations

import functools
import hashlib
import os

from numba import njit
from numba.core import caching

# Every file whose code a kernel may compile in (tests/test_kernels_cpu.py checks the list).
SOURCES = ("cache.py", "codecs.py", "simd.py", "rows.py", "rmsnorm.py", "layernorm.py", "dynamic_tanh.py")
HERE = os.path.dirname(os.path.abspath(__file__))

# Reassociation lets LLVM vectorize the reductions. No nnan/ninf: inf and nan rows must behave as
# IEEE says (and stay in their row). No contraction either: an FMA in g - mean(g) leaves the
# rounding error of g (times rstd, up to 1/sqrt(eps)) where the exact answer is 0.
FASTMATH = {"reassoc"}


@functools.cache
def sources_hash() -> str:
    digest = hashlib.sha256()
    for name in SOURCES:
        with open(os.path.join(HERE, name), "rb") as f:
            digest.update(name.encode() + b"\0" + f.read() + b"\0")
    return digest.hexdigest()[:16]


class _SourcesLocator(caching._CacheLocator):
    """Where numba would cache the function (NUMBA_CACHE_DIR, the package's __pycache__ or the
    user-wide cache, in numba's order), one directory down: ``normlab-<sources_hash()>``."""

    def __init__(self, base: caching._CacheLocator, py_file: str, lineno: int) -> None:
        self._path = os.path.join(base.get_cache_path(), "normlab-" + sources_hash())
        self._py_file, self._lineno = py_file, lineno  # numba names them when it cannot cache a function

    def get_cache_path(self) -> str:
        return self._path

    def get_source_stamp(self) -> str:
        return sources_hash()

    def get_disambiguator(self) -> str:
        return str(self._lineno)

    @classmethod
    def from_function(cls, py_func, py_file):
        for base_class in caching.CacheImpl._locator_classes:
            base = base_class.from_function(py_func, py_file)
            if base is None:
                continue
            locator = cls(base, py_file, py_func.__code__.co_firstlineno)
            try:
                locator.ensure_cache_path()
            except OSError:
                continue
            return locator
        return None


class _Impl(caching.CompileResultCacheImpl):
    _locator_classes = [_SourcesLocator]


class _Cache(caching.FunctionCache):
    _impl_class = _Impl


def kernel(fn):
    """A parallel numba kernel, cached under sources_hash()."""
    dispatcher = njit(parallel=True, fastmath=FASTMATH, nogil=True)(fn)
    dispatcher._cache = _Cache(fn)  # what Dispatcher.enable_caching does, with this locator
    return dispatcher

