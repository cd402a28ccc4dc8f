"""numba's on-disk cache for this package, keyed by the hash of all its kernel sources.

numba keys a cached function by the file that defines it, but a kernel here inlines helpers
from other files (codecs.py, simd.py, rows.py): after an edit to a helper, the kernel's file is
unchanged and numba would load the stale machine code. So every kernel is cached in a directory
named by the hash of every file in SOURCES, and stamped with it: any edit there recompiles them
all, and two versions of the package (two checkouts, an A/B run) keep separate caches. The hash
makes one user-wide cache safe to share, so that is the default (every clone and environment
with the same sources reuses the kernels): NUMBA_CACHE_DIR if set, else ~/.cache/normlab/numba
(XDG_CACHE_HOME), else where numba itself would put it.

Each cache file carries the sha256 of its contents, checked before pickle or LLVM reads a byte
(LLVM aborts the process on some damaged object code): an entry that cannot be loaded is
discarded with a warning and the kernel compiled again.

**Tiers.** A fresh install has no cache, and compiling a kernel takes 5-30 s. So a platform wheel
ships kernels compiled ahead of time for the portable x86-64 levels ``x86-64-v3`` (AVX2) and
``x86-64-v4`` (AVX-512), the bf16 kernels once more for ``x86-64-v4-bf16`` (v4 with the
AVX512-BF16 conversions) and the bf16 and fp16 ones for ``x86-64-v3-zen`` (v3 scheduled for
AMD's CPUs), and an ARM64 wheel the level ``aarch64`` (LLVM's generic ARMv8-A CPU, NEON, built
under emulation on x86-64), in ``tiers/<level>/`` (tools/build_tiers.py). Compiling for a level
rather than the builder's CPU makes the code run on every CPU with that level's features, and
numba's cache key then names the level instead of the CPU. A kernel with no entry in the user's
cache is loaded from the best level this CPU supports that holds it; only where none does
(another CPU family, another numba or Python) is it compiled here. NORMLAB_CPU_TIERS=off turns tiers off
(the kernels are then always compiled for this exact CPU), a path points at another tiers folder
(one that is not a folder is warned about, and no tiers are loaded).
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import sys
import warnings

import numba
from llvmlite import binding as llvm
from numba import njit
from numba.core import caching

from normlab import env

# Every file whose code a kernel may compile in (tests/test_cpu_cache.py checks the list).
SOURCES = ("cache.py", "codecs.py", "simd.py", "rows.py", "rmsnorm.py", "layernorm.py", "layernorm_bwd.py",
           "tanh_erf.py", "pointwise.py")
HERE = os.path.dirname(os.path.abspath(__file__))

# Reassociation lets LLVM vectorize the reductions. No nnan/ninf: inf and nan rows must behave as
# IEEE says (and stay in their row). No contraction either: an FMA in g - mean(g) leaves the
# rounding error of g (times rstd, up to 1/sqrt(eps)) where the exact answer is 0.
FASTMATH = {"reassoc"}


# The x86-64 psABI's microarchitecture levels that tiers are built for, with the LLVM features each
# requires (every level includes the ones before it).
_V2 = ("cx16", "popcnt", "sahf", "sse3", "sse4.1", "sse4.2", "ssse3")
_V3 = _V2 + ("avx", "avx2", "bmi", "bmi2", "f16c", "fma", "lzcnt", "movbe", "xsave")
_V4 = _V3 + ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
TIERS = {"x86-64-v4-bf16": _V4 + ("avx512bf16",), "x86-64-v4": _V4, "x86-64-v3-zen": _V3
         + ("sse4a", "prfchw"), "x86-64-v3": _V3,
         # every ARM64 CPU has NEON (ARMv8-A makes it part of the architecture): one level, compiled
         # for LLVM's generic aarch64 CPU, runs on all of them
         "aarch64": ()}
TIERS_DIR = os.path.join(HERE, "tiers")

# A level that is not a psABI level is compiled for an LLVM CPU name and features of its own, and
# only for the dtypes whose code they change (the rest load from the next level down):
# - x86-64-v4-bf16: v4 plus AVX512-BF16. Without the instruction v4 rounds bf16 with integer
#   arithmetic: 0.75-0.8x the speed of a Zen 5's own code in bf16 forwards on rows of 1024.
# - x86-64-v3-zen: for AMD's AVX2 CPUs (sse4a only AMD has; prfchw all of them), v3's instructions
#   scheduled as LLVM does for a Zen 3: instruction for instruction the code a Zen 3 compiles for
#   itself, where the generic v3 level lost up to a fifth in the bf16 backward there.
# (docs/cpu-kernels.md, "tiers").
_ZEN3_BEYOND_V3 = ("adx", "aes", "clflushopt", "clwb", "clzero", "fsgsbase", "invpcid", "mwaitx", "pclmul",
                   "pku", "rdpid",
                   "rdpru", "rdrnd", "rdseed", "sha", "vaes", "vpclmulqdq", "wbnoinvd", "xsavec", "xsaveopt",
                   "xsaves")
EXTENDED = {"x86-64-v4-bf16": ("x86-64-v4", "+avx512bf16", "bf16"),
            "x86-64-v3-zen": ("znver3", ",".join("-" + f for f in _ZEN3_BEYOND_V3), "bf16,fp16")}


def llvm_target(level: str) -> tuple[str, str]:
    """(NUMBA_CPU_NAME, NUMBA_CPU_FEATURES) a level's kernels are compiled for: its cache key."""
    if level == "aarch64":
        return "generic", ""
    name, features, _ = EXTENDED.get(level, (level, "", None))
    return name, features


def level_arch(level: str) -> str:
    """The machine a level's code runs on: "aarch64" or "x86_64"."""
    return "aarch64" if level == "aarch64" else "x86_64"


def process_arch() -> str:
    """This process's machine as the levels name it ("x86_64", "aarch64"; anything else as LLVM says)."""
    arch = llvm.get_process_triple().split("-")[0]
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(arch, arch)


def target_features() -> dict[str, bool]:
    """The CPU features the kernels are compiled for: the host's, or in a process whose numba
    targets a named CPU (NUMBA_CPU_NAME, as a tier build does) that level's, and none for any
    other name (no AVX-512 or bf16 instruction the named CPU may lack)."""
    if numba.config.CPU_NAME is None:
        return dict(llvm.get_host_cpu_features())
    target = (numba.config.CPU_NAME, numba.config.CPU_FEATURES or "")
    return next((dict.fromkeys(needs, True) for level, needs in TIERS.items()
                 if llvm_target(level) == target), {})


@functools.cache
def host_tiers() -> tuple[tuple[str, str], ...]:
    """(level, folder) of every shipped tier this CPU can run for these sources, best first; none
    when tiers are off, numba is told to target a CPU, the CPU is neither x86-64 nor ARM64, or
    nothing is shipped."""
    setting = os.environ.get("NORMLAB_CPU_TIERS", "")
    if setting.lower() in ("off", "0", "false", "no") or numba.config.CPU_NAME is not None:
        return ()
    arch = process_arch()
    if arch not in {level_arch(level) for level in TIERS}:
        return ()
    if setting and not os.path.isdir(setting):
        warnings.warn(f"NORMLAB_CPU_TIERS={setting!r} is neither off nor a folder: no shipped kernels are "
                      "loaded, each is compiled for this CPU", stacklevel=2)
        return ()
    host = llvm.get_host_cpu_features()
    found = []
    for level, needs in TIERS.items():
        folder = os.path.join(setting or TIERS_DIR, level, "normlab-" + sources_hash())
        if level_arch(level) == arch and all(host.get(f, False) for f in needs) and os.path.isdir(folder):
            found.append((level, folder))
    return tuple(found)


def host_tier() -> tuple[str, str] | None:
    """(level, folder) of the best shipped tier this CPU can run, or None."""
    return next(iter(host_tiers()), None)


@functools.cache
def sources_hash() -> str:
    digest = hashlib.sha256()
    for name in SOURCES:
        with open(os.path.join(HERE, name), "rb") as f:
            digest.update(name.encode() + b"\0" + f.read() + b"\0")
    return digest.hexdigest()[:16]


class _SourcesLocator(caching._CacheLocator):
    """The first writable of NUMBA_CACHE_DIR, env.user_cache("numba") and numba's own choices (the package's
    __pycache__, numba's user-wide cache), one directory down: ``normlab-<sources_hash()>``."""

    def __init__(self, base: str, py_file: str, lineno: int) -> None:
        self._path = os.path.join(base, "normlab-" + sources_hash())
        self._py_file, self._lineno = py_file, lineno  # numba names them when it cannot cache a function

    def get_cache_path(self) -> str:
        return self._path

    def get_source_stamp(self) -> str:
        return sources_hash()

    def get_disambiguator(self) -> str:
        return str(self._lineno)

    @classmethod
    def from_function(cls, py_func, py_file):
        # numba's own order starts with NUMBA_CACHE_DIR (None when unset); ours goes second
        user_set, *numba_own = [c.from_function(py_func, py_file) for c in caching.CacheImpl._locator_classes]
        bases = [b.get_cache_path() for b in (user_set,)
                 if b] + [env.user_cache("numba")] + [b.get_cache_path() for b in numba_own if b]
        for base in bases:
            locator = cls(base, py_file, py_func.__code__.co_firstlineno)
            try:
                locator.ensure_cache_path()
            except OSError:
                continue
            return locator
        return None


class _Impl(caching.CompileResultCacheImpl):
    _locator_classes = [_SourcesLocator]


_DIGEST = hashlib.sha256().digest_size


class CorruptCacheFile(Exception):
    """A cache file whose contents do not match its checksum: damaged on disk."""


def _verified(blob: bytes, path: str) -> bytes:
    digest, payload = blob[:_DIGEST], blob[_DIGEST:]
    if len(blob) < _DIGEST or hashlib.sha256(payload).digest() != digest:
        raise CorruptCacheFile(f"{path} does not match its checksum")
    return payload


class _CheckedFile(caching.IndexDataCacheFile):
    """numba's index and data files, each with the sha256 of its contents in front."""

    def _dump(self, obj) -> bytes:
        payload = super()._dump(obj)
        return hashlib.sha256(payload).digest() + payload

    def _load_index(self) -> dict:
        try:
            with open(self._index_path, "rb") as f:
                version = pickle.load(f)
                blob = f.read()
        except FileNotFoundError:
            return {}
        if version != self._version:  # another numba's index: start afresh, as numba does
            return {}
        stamp, overloads = pickle.loads(_verified(blob, self._index_path))
        return overloads if stamp == self._source_stamp else {}

    def _load_data(self, name: str):
        path = self._data_path(name)
        with open(path, "rb") as f:
            return pickle.loads(_verified(f.read(), path))


_told = False


def _say_compiling(folder: str) -> None:
    """One line on stderr, once a process, before the first kernel that is not cached compiles:
    otherwise a first call blocks for seconds without a word."""
    global _told
    if not _told:
        _told = True
        print("normlab: compiling the fused CPU kernels this call needs (5-30 s each, once; then cached in "
              f"{folder}). `normlab warmup` compiles them ahead of time.", file=sys.stderr, flush=True)


_host_only = False  # set by compile_for_host()


def compile_for_host() -> None:
    """From now on this process compiles what the user's cache lacks for this exact CPU instead of
    loading a tier (`normlab warmup`: host code can use more, e.g. AVX512-BF16, than a level)."""
    global _host_only
    _host_only = True


class _Cache(caching.FunctionCache):
    _impl_class = _Impl
    _tiered = True

    def __init__(self, py_func) -> None:
        super().__init__(py_func)
        stamp = self._impl.locator.get_source_stamp()
        self._cache_file = _CheckedFile(self._cache_path, self._impl.filename_base, stamp)
        tiers = host_tiers() if self._tiered else ()
        self._tiers = [(level, _CheckedFile(folder, self._impl.filename_base, stamp))
                       for level, folder in tiers]

    def _load_overload(self, sig, target_context):
        loaded = super()._load_overload(sig, target_context)
        if loaded is not None or _host_only:
            return loaded
        key = self._index_key(sig, target_context.codegen())
        for level, tier_file in self._tiers:  # the key of the same code compiled for the level
            try:
                data = tier_file.load((key[0], (key[1][0], *llvm_target(level)), *key[2:]))
                if data:
                    return self._impl.rebuild(target_context, data)
            # damaged in the install: compile it for this CPU (the tier is left as it is)
            except Exception as err:
                warnings.warn(f"normlab: the {level} kernel {self._py_func.__name__} in "
                              f"{tier_file._index_path} could not be loaded ({type(err).__name__}: "
                              f"{str(err)[:200]}); compiling it for this CPU", RuntimeWarning, stacklevel=2)
                return None
        return None

    def load_overload(self, sig, target_context):
        try:
            loaded = super().load_overload(sig, target_context)
            if loaded is None:  # numba compiles it next
                _say_compiling(self._cache_path)
            return loaded
        except Exception as err:  # damage on disk (pickle, LLVM and checksum errors alike): compile again
            warnings.warn(f"normlab: numba's cache for {self._py_func.__name__} could not be loaded "
                          f"({type(err).__name__}: {str(err)[:200]}); discarding "
                          f"{self._cache_file._index_path} and compiling the kernel again",
                          RuntimeWarning, stacklevel=2)
            try:
                os.remove(self._cache_file._index_path)
            except OSError:
                pass
            return None


class _SerialLocator(_SourcesLocator):
    def get_disambiguator(self) -> str:  # its own cache files: the same function, compiled without parallel
        return super().get_disambiguator() + "-serial"


class _SerialImpl(caching.CompileResultCacheImpl):
    _locator_classes = [_SerialLocator]


class _SerialCache(_Cache):
    _impl_class = _SerialImpl
    _tiered = False  # only forked workers meet these: not worth a wheel's space


def kernel(fn):
    """A parallel numba kernel, cached under sources_hash(). ``kernel.serial()`` is the same code
    compiled without numba's threading layer (prange as range), for a process forked after its
    parent started GNU OpenMP, which numba's omp layer cannot run in."""
    dispatcher = njit(parallel=True, fastmath=FASTMATH, nogil=True)(fn)
    dispatcher._cache = _Cache(fn)  # what Dispatcher.enable_caching does, with this locator

    @functools.cache
    def serial():
        plain = njit(fastmath=FASTMATH, nogil=True)(fn)
        plain._cache = _SerialCache(fn)
        return plain

    dispatcher.serial = serial
    return dispatcher

