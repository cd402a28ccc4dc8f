"""The CPU backend's choice and numba's on-disk cache: the reason a missing or old numba gives,
a cache keyed by every kernel source (an edited helper recompiles), damaged entries discarded, a
user-wide default, and kernels numba cannot cache still running."""

import os
from pathlib import Path

import numba
import numpy as np
import pytest
import torch

from normlab import kernels

pytest.importorskip("numba", reason="the cpu backend needs numba (pip install normlab[cpu])")
from normlab.kernels import cpu  # noqa: E402


def test_a_numba_older_than_the_kernels_need_is_named_in_the_reason():
    assert kernels._too_old("numba", "0.68.1") is None and kernels._too_old("numba", "1.0") is None
    reason = kernels._too_old("numba", "0.59.0")
    assert "numba 0.59.0" in reason and ">=0.68" in reason
    assert kernels._too_old("torch", "2.0") is None  # no floor set
    # Triton 3.8 fails on the kernels' bf16 eps-outside options ("Cannot bitcast data-type of size 64")
    assert kernels._too_old("triton", "3.9.0") is None
    assert "triton 3.8.0 is older than the 3.9" in kernels._too_old("triton", "3.8.0")


def test_cpu_backend_is_what_auto_picks_for_cpu_tensors():
    assert kernels.unavailable_reason("cpu") is None
    assert kernels.resolve(None, torch.device("cpu")) == "cpu"


def test_cache_status_reports_every_kernel():
    status = cpu.cache_status()
    assert set(status["kernels"]) == {k.__name__ for k in cpu.KERNELS}
    assert status["warm"] == all(status["kernels"].values())


def test_every_file_with_numba_code_is_in_the_cache_key():
    # cache.SOURCES decides which edits recompile the kernels: a file of jitted helpers left out
    # of it would let an edit there reach no kernel until the cache is cleared.
    import re

    from normlab.kernels.cpu import cache

    jitted = re.compile(r"^@(njit|intrinsic|overload|kernel)\b|= "
                        r"(intrinsic|forward_block|backward_block|grad_sums)\(", re.M)
    folder = Path(cache.__file__).parent
    with_code = {p.name for p in folder.glob("*.py") if jitted.search(p.read_text())}
    assert with_code and with_code <= set(cache.SOURCES), with_code - set(cache.SOURCES)
    assert all((folder / name).exists() for name in cache.SOURCES)


_CACHE_PROBE = """
import torch
from normlab import functional as F
from normlab.kernels.cpu import rmsnorm
y = F.rms_norm(torch.linspace(-1, 1, 64 * 32).view(64, 32), backend="cpu")
stats = rmsnorm.rms_fwd.stats
print(sum(stats.cache_hits.values()), sum(stats.cache_misses.values()), float(y.abs().sum()))
"""


def test_a_changed_helper_recompiles_the_kernels_that_inline_it(tmp_path):
    # numba keys its cache by the defining file alone; rms_fwd inlines recip from rows.py, so
    # with numba's own key an edit to recip would be served stale from the cache.
    import shutil
    import subprocess
    import sys

    src = tmp_path / "src"
    shutil.copytree(Path(cpu.__file__).parents[2], src / "normlab",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(src), "NUMBA_CACHE_DIR": str(tmp_path / "numba")}

    said = []

    def probe():
        done = subprocess.run([sys.executable, "-c", _CACHE_PROBE], env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        said.append(done.stderr)
        hits, misses, total = done.stdout.split()
        return int(hits), int(misses), float(total)

    hits, misses, first = probe()
    assert misses == 1 and hits == 0  # cold: compiled
    # and said so, once, with what to do about it (a first call blocked for seconds silently)
    assert said[-1].count("normlab: compiling the fused CPU kernels") == 1 and "normlab warmup" in said[-1]
    hits, misses, again = probe()
    assert hits == 1 and misses == 0 and again == first  # warm: from the cache
    assert "compiling" not in said[-1]
    rows = src / "normlab" / "kernels" / "cpu" / "rows.py"
    text = rows.read_text()
    assert "np.float32(1.0 / x)" in text
    rows.write_text(text.replace("np.float32(1.0 / x)", "np.float32(2.0 / x)"))
    hits, misses, changed = probe()
    assert misses == 1 and hits == 0
    assert changed == pytest.approx(2 * first, rel=1e-6)  # the edit reached the kernel


_BIG = np.ones(2_000_000)  # a large global array: numba will not cache code that embeds it


def test_a_kernel_numba_cannot_cache_warns_and_runs():
    from numba.core.errors import NumbaWarning

    from normlab.kernels.cpu import cache

    def uses_a_big_global(x):
        return x[0] + _BIG[0]

    kernel = cache.kernel(uses_a_big_global)
    with pytest.warns(NumbaWarning, match="Cannot cache"):
        assert kernel(np.full(3, 2.0)) == 3.0


def _toy_sum(x):  # elementwise, so that its bits do not depend on how the threads split the loop
    out = np.empty_like(x)
    for i in numba.prange(x.shape[0]):
        out[i] = x[i] * 2.0 + 1.0
    return out


def _toy_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*_toy_sum*") if p.suffix in (".nbi", ".nbc"))


@pytest.mark.parametrize("damage",
                         ["index cut short", "index garbled", "data at 30%", "data at 50%", "data at 80%",
                          "data emptied", "data another valid pickle"])
def test_a_damaged_cache_entry_is_discarded_and_compiled_again(damage, tmp_path, monkeypatch):
    # a damaged entry crashed numba (EOFError, UnpicklingError, LLVM aborting the process); it
    # must instead warn, compile again and give the same answer
    import pickle

    from numba.core import config

    from normlab.kernels.cpu import cache

    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path))
    x = np.random.default_rng().standard_normal(1000)
    first = cache.kernel(_toy_sum)
    want = first(x)
    assert sum(first.stats.cache_misses.values()) == 1
    index = next(p for p in _toy_files(tmp_path) if p.suffix == ".nbi")
    data = next(p for p in _toy_files(tmp_path) if p.suffix == ".nbc")
    if damage.startswith("index"):
        blob = index.read_bytes()
        index.write_bytes(blob[: len(blob) // 2] if damage == "index cut short"
                          else blob[:-40] + os.urandom(40))
    elif damage == "data emptied":
        data.write_bytes(b"")
    elif damage == "data another valid pickle":
        data.write_bytes(pickle.dumps({"not": "a kernel"}))
    else:
        blob = bytearray(data.read_bytes())
        at = len(blob) * int(damage[-3:-1]) // 100
        blob[at:at + 64] = os.urandom(64)
        data.write_bytes(bytes(blob))
    again = cache.kernel(_toy_sum)  # a new process's dispatcher: it loads from the cache first
    with pytest.warns(RuntimeWarning, match="could not be loaded.*compiling the kernel again"):
        assert np.array_equal(again(x), want)
    assert sum(again.stats.cache_misses.values()) == 1 and sum(again.stats.cache_hits.values()) == 0
    third = cache.kernel(_toy_sum)  # what the recompile saved loads cleanly
    assert np.array_equal(third(x), want) and sum(third.stats.cache_hits.values()) == 1


def test_the_cache_is_user_wide_by_default(tmp_path, monkeypatch):
    # keyed by the sources' hash, one cache serves every clone and environment of the same sources
    from numba.core import config

    from normlab.kernels.cpu import cache

    monkeypatch.setattr(config, "CACHE_DIR", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    kernel = cache.kernel(_toy_sum)
    kernel(np.ones(10))
    assert _toy_files(tmp_path / "normlab" / "numba" / f"normlab-{cache.sources_hash()}")
