"""Kernels compiled ahead of time for a portable x86-64 level (tools/build_tiers.py), as a platform
wheel ships them: a fresh process loads them instead of compiling, with the bits of the level's
code compiled here (on an AVX2 host, the host kernels' bits); a level the CPU cannot run, or a tier
from another numba, is never loaded."""

import math
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow(minutes=4)  # minutes cold on 2 cores (conftest.py)
pytest.importorskip("numba", reason="the cpu backend needs numba")
from llvmlite import binding as llvm  # noqa: E402

from normlab.kernels.cpu import cache  # noqa: E402
from normlab.testing import assert_close  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import build_tiers  # noqa: E402

HOST = llvm.get_host_cpu_features()
V3_HOST = all(HOST.get(f, False) for f in cache.TIERS["x86-64-v3"])

# A fresh process: its first rms_norm forward and backward on fixed inputs in each dtype of
# argv[3] (default fp32), what it compiled and loaded, and the first dtype's outputs saved for a
# comparison of bits.
PROBE = """
import sys, torch
import normlab
from normlab.kernels import cpu
from normlab.kernels.cpu import cache
saved = None
for name in (sys.argv[3] if len(sys.argv) > 3 else "fp32").split(","):
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1000, generator=g).to(dtype).requires_grad_()
    w = torch.randn(1000, generator=g).to(dtype).requires_grad_()
    y = normlab.rms_norm(x, w, backend="cpu")
    if sys.argv[2] == "both":
        y.backward(torch.randn(64, 1000, generator=g).to(dtype))
    saved = saved or {"y": y.detach(), "dx": x.grad, "dw": w.grad}
compiled, loaded = cpu.compiled_and_loaded()
print(compiled, loaded, (cache.host_tier() or ["none"])[0])
torch.save(saved, sys.argv[1])
"""


def _probe(tmp_path: Path, tiers: str, name: str, passes: str = "both", dtypes: str = "fp32",
           **extra_env: str) -> tuple[int, int, str, dict, str]:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / f"numba-{name}"), "NORMLAB_CPU_TIERS": tiers,
           **extra_env}
    out = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / f"{name}.pt"), passes, dtypes], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    compiled, loaded, level = out.stdout.split()
    return int(compiled), int(loaded), level, torch.load(tmp_path / f"{name}.pt",
                                                         weights_only=True), out.stderr


def _level_compiled_here(tmp_path: Path, level: str) -> dict:
    """The probe's outputs from ``level``'s code compiled in a fresh process (numba told to target
    the level, as build_tiers does), not loaded from a tier."""
    cpu_name, features = cache.llvm_target(level)
    return _probe(tmp_path, "off", f"{level}-here", NUMBA_CPU_NAME=cpu_name, NUMBA_CPU_FEATURES=features)[3]


def _host_kernels(backend: str = "cpu", dtype: torch.dtype = torch.float32,
                  rounded: torch.dtype = torch.float64) -> dict:
    """The probe's call in this process, whose kernels are compiled for this CPU (tiers are off in
    tests); with backend="reference" and float64, the truth it approximates for inputs ``rounded``
    to the probe's dtype."""
    import normlab

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1000, generator=g).to(rounded).to(dtype).requires_grad_()
    w = torch.randn(1000, generator=g).to(rounded).to(dtype).requires_grad_()
    y = normlab.rms_norm(x, w, backend=backend)
    y.backward(torch.randn(64, 1000, generator=g).to(rounded).to(dtype))
    return {"y": y.detach(), "dx": x.grad, "dw": w.grad}


@pytest.fixture(scope="module")
def tiers(tmp_path_factory) -> Path:
    """The x86-64-v3 level of the fp32 rms_norm kernels, built as a wheel's would be."""
    out = tmp_path_factory.mktemp("tiers")
    build_tiers.build("x86-64-v3", out, ops="rms_norm", dtypes="fp32")
    return out


@pytest.mark.skipif(not V3_HOST, reason="loading an x86-64-v3 tier needs a CPU with AVX2 (an x86-64-v3 CPU)")
def test_a_tier_built_in_one_process_loads_without_compiling_in_another(tiers, tmp_path):
    assert (tiers / "x86-64-v3" / f"normlab-{cache.sources_hash()}").is_dir()
    compiled, loaded, level, got, err = _probe(tmp_path, str(tiers), "tier")
    assert (compiled, level) == (0, "x86-64-v3") and loaded >= 2, err
    assert "compiling" not in err  # not even the kernel that starts numba's threads
    host = _host_kernels()
    if HOST.get("avx512f", False):
        # Host code sums in AVX-512's 16 lanes, the level's in AVX2's 8: other bits, the same bound.
        # The tier must give what the level's code compiled here gives, bit for bit.
        level_here = _level_compiled_here(tmp_path, "x86-64-v3")
        for key in ("y", "dx", "dw"):
            assert torch.equal(got[key], level_here[key]), key
        truth = _host_kernels("reference", torch.float64)
        for key, rule in (("y", "element"), ("dx", "row"), ("dw", "tensor")):
            assert_close(got[key], truth[key], name=key, rule=rule)
            assert_close(host[key], truth[key], name=key, rule=rule)
    else:  # an AVX2 host: the kernels compiled for this very CPU give the same bits
        for key in ("y", "dx", "dw"):
            assert torch.equal(got[key], host[key]), key


@pytest.mark.skipif(not V3_HOST, reason="loading an x86-64-v3 tier needs a CPU with AVX2 (an x86-64-v3 CPU)")
def test_a_tier_from_another_numba_is_compiled_over_not_loaded(tiers, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(tiers, other)
    for index in other.rglob("*.nbi"):
        data = index.read_bytes()
        version = pickle.loads(data)  # the index starts with the numba version that wrote it
        index.write_bytes(pickle.dumps("0.1.0") + data[len(pickle.dumps(version)):])
    compiled, loaded, _, _, err = _probe(tmp_path, str(other), "other", passes="forward")
    assert compiled == 1 and loaded == 0 and "compiling" in err


@pytest.mark.skipif(not V3_HOST, reason="loading an x86-64-v3 tier needs a CPU with AVX2 (an x86-64-v3 CPU)")
def test_a_damaged_tier_entry_is_compiled_over_with_a_warning(tiers, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(tiers, damaged)
    for data in damaged.rglob("rmsnorm.rms_fwd-*.nbc"):
        blob = bytearray(data.read_bytes())
        blob[len(blob) // 2] ^= 0xFF
        data.write_bytes(bytes(blob))
    compiled, loaded, level, got, err = _probe(tmp_path, str(damaged), "damaged", passes="forward")
    assert (compiled, level) == (1, "x86-64-v3") and "could not be loaded" in err and "rms_fwd" in err
    assert torch.equal(got["y"], _host_kernels()["y"])


@pytest.mark.skipif(not all(HOST.get(f, False) for f in cache.TIERS["x86-64-v4-bf16"]),
                    reason="loading the x86-64-v4-bf16 level needs a CPU with AVX-512 and AVX512-BF16")
def test_bf16_kernels_load_from_the_bf16_level_and_the_rest_from_v4(tmp_path):
    # Each level holds one dtype here, so nothing compiled means each call found its own level.
    out = tmp_path / "tiers"
    build_tiers.build("x86-64-v4", out, ops="rms_norm", dtypes="fp32")
    # it holds bf16 only
    assert build_tiers.build("x86-64-v4-bf16", out, ops="rms_norm", dtypes="fp32") is None
    build_tiers.build("x86-64-v4-bf16", out, ops="rms_norm")
    assert sorted(p.name for p in out.iterdir()) == ["x86-64-v4", "x86-64-v4-bf16"]
    compiled, loaded, level, got, err = _probe(tmp_path, str(out), "tier", dtypes="bf16,fp32")
    assert (compiled, level) == (0, "x86-64-v4-bf16") and loaded >= 4, err
    # The loaded code computes the norm (its bits against the level compiled here are the x86-64-v3
    # test's: a second compile would cost this test a third of its time).
    truth = _host_kernels("reference", torch.float64, rounded=torch.bfloat16)
    for key, rule in (("y", "element"), ("dx", "row"), ("dw", "tensor")):
        assert got[key].dtype == torch.bfloat16
        assert_close(got[key], truth[key], name=key, rule=rule)


def test_the_host_loads_the_best_level_it_can_run_and_nothing_else(tmp_path, monkeypatch):
    for level in cache.TIERS:
        (tmp_path / level / f"normlab-{cache.sources_hash()}").mkdir(parents=True)
    monkeypatch.setenv("NORMLAB_CPU_TIERS", str(tmp_path))

    def host_with(features):
        monkeypatch.setattr(cache.llvm, "get_host_cpu_features", lambda: dict.fromkeys(features, True))
        cache.host_tiers.cache_clear()
        found = cache.host_tier()
        return found and found[0]

    try:
        assert host_with(cache.TIERS["x86-64-v4"] + ("avx512bf16",)) == "x86-64-v4-bf16"
        assert [level for level, _ in cache.host_tiers()] == ["x86-64-v4-bf16", "x86-64-v4", "x86-64-v3"]
        assert host_with(cache.TIERS["x86-64-v4"]) == "x86-64-v4"  # AVX-512 without the bf16 conversions
        assert [level for level, _ in cache.host_tiers()] == ["x86-64-v4", "x86-64-v3"]
        assert host_with(cache.TIERS["x86-64-v3"] + ("avx512f",)) == "x86-64-v3"  # AVX-512 in part is not v4
        assert host_with(cache.TIERS["x86-64-v3"] + ("prfchw",)) == "x86-64-v3"  # an Intel AVX2 CPU: no sse4a
        zen3 = cache.TIERS["x86-64-v3"] + ("sse4a", "prfchw", "sha", "clzero")
        # an AMD one, with the generic level behind it (fp32 kernels)
        assert host_with(zen3) == "x86-64-v3-zen"
        assert [level for level, _ in cache.host_tiers()] == ["x86-64-v3-zen", "x86-64-v3"]
        # Zen 4, 5: AVX-512 first
        assert host_with(cache.TIERS["x86-64-v4-bf16"] + ("sse4a", "prfchw")) == "x86-64-v4-bf16"
        assert [level for level, _ in cache.host_tiers()] == ["x86-64-v4-bf16", "x86-64-v4", "x86-64-v3-zen",
                                                              "x86-64-v3"]
        assert host_with([f for f in cache.TIERS["x86-64-v3"] if f != "movbe"]) is None
        shutil.rmtree(tmp_path / "x86-64-v3-zen")
        shutil.rmtree(tmp_path / "x86-64-v3")
        assert host_with(cache.TIERS["x86-64-v3"]) is None  # an AVX2 CPU never loads the AVX-512 level
        monkeypatch.setenv("NORMLAB_CPU_TIERS", "off")
        assert host_with(cache.TIERS["x86-64-v4"]) is None
        monkeypatch.setenv("NORMLAB_CPU_TIERS", str(tmp_path / "typo"))
        with pytest.warns(UserWarning, match="NORMLAB_CPU_TIERS=.*typo.* neither off nor a folder"):
            assert host_with(cache.TIERS["x86-64-v4"]) is None
        monkeypatch.setenv("NORMLAB_CPU_TIERS", str(tmp_path))
        monkeypatch.setattr(cache.numba.config, "CPU_NAME", "skylake-avx512")  # the user chose a target
        assert host_with(cache.TIERS["x86-64-v4"]) is None
    finally:
        cache.host_tiers.cache_clear()


def test_an_arm64_host_loads_the_aarch64_level_and_never_an_x86_one(tmp_path, monkeypatch):
    for level in cache.TIERS:
        (tmp_path / level / f"normlab-{cache.sources_hash()}").mkdir(parents=True)
    monkeypatch.setenv("NORMLAB_CPU_TIERS", str(tmp_path))

    def levels(triple, features):
        monkeypatch.setattr(cache.llvm, "get_process_triple", lambda: triple)
        monkeypatch.setattr(cache.llvm, "get_host_cpu_features", lambda: dict.fromkeys(features, True))
        cache.host_tiers.cache_clear()
        return [level for level, _ in cache.host_tiers()]

    arm = "aarch64-unknown-linux-gnu"
    try:
        assert levels(arm, ("neon", "fp-armv8", "sve")) == ["aarch64"]
        assert levels(arm, ()) == ["aarch64"]  # NEON is in every ARM64 CPU: the level asks for nothing
        # a level is for one machine: x86 feature names on an ARM64 host load no x86 level
        assert levels(arm, cache.TIERS["x86-64-v4-bf16"]) == ["aarch64"]
        assert levels("x86_64-unknown-linux-gnu", cache.TIERS["x86-64-v3"]) == ["x86-64-v3"]
        assert levels("x86_64-unknown-linux-gnu", ()) == []
        assert levels("powerpc64le-unknown-linux-gnu", ()) == []
        shutil.rmtree(tmp_path / "aarch64")
        assert levels("arm64-unknown-linux-gnu", ("neon",)) == []
    finally:
        cache.host_tiers.cache_clear()
    assert cache.llvm_target("aarch64") == ("generic", "")
    monkeypatch.setattr(cache.numba.config, "CPU_NAME", "generic")  # the aarch64 level's build
    monkeypatch.setattr(cache.numba.config, "CPU_FEATURES", "")
    assert cache.target_features() == {}


def test_the_arm64_level_is_built_by_an_arm64_python(tmp_path, monkeypatch):
    """On x86-64 under emulation (tools/qemu_arm.sh), on an ARM64 machine by its own Python; the x86
    levels only on x86-64."""
    calls = []
    monkeypatch.setattr(build_tiers.subprocess, "run", lambda cmd, env, check: calls.append((cmd, env)))
    monkeypatch.setattr(build_tiers, "process_arch", lambda: "x86_64")
    build_tiers.build("aarch64", tmp_path, ops="rms_norm")
    (cmd, env), = calls
    assert cmd[:3] == ["bash", str(ROOT / "tools" / "qemu_arm.sh"), "python"]
    assert cmd[3:6] == [build_tiers.__file__, "--compile-only", "--ops"] and "rms_norm" in cmd
    assert (env["NUMBA_CPU_NAME"], env["NUMBA_CPU_FEATURES"]) == ("generic", "")
    assert env["NUMBA_CACHE_DIR"] == str(tmp_path / "aarch64")
    monkeypatch.setattr(build_tiers, "process_arch", lambda: "aarch64")
    build_tiers.build("aarch64", tmp_path)
    assert calls[1][0][0] == sys.executable
    with pytest.raises(ValueError, match="x86-64-v3 can only be built on an x86-64 machine"):
        build_tiers.build("x86-64-v3", tmp_path)
    assert build_tiers.levels_for("aarch64") == ["aarch64"]
    assert build_tiers.levels_for("x86_64") == ["x86-64-v4-bf16", "x86-64-v4", "x86-64-v3-zen", "x86-64-v3"]


def test_info_names_the_levels_it_would_load_best_first(tmp_path, monkeypatch, capsys):
    from normlab import cli

    for level in cache.TIERS:
        (tmp_path / level / f"normlab-{cache.sources_hash()}").mkdir(parents=True)
    monkeypatch.setenv("NORMLAB_CPU_TIERS", str(tmp_path))
    monkeypatch.setattr(cache.llvm, "get_host_cpu_features",
                        lambda: dict.fromkeys(cache.TIERS["x86-64-v4"], True))
    cache.host_tiers.cache_clear()
    try:
        assert cli.main(["info"]) == 0
    finally:
        cache.host_tiers.cache_clear()
    out = " ".join(capsys.readouterr().out.split())
    assert f"ahead-of-time kernels: x86-64-v4, x86-64-v3 in {tmp_path}" in out


def test_a_level_build_compiles_for_the_levels_features_not_the_hosts(monkeypatch):
    monkeypatch.setattr(cache.numba.config, "CPU_NAME", "x86-64-v4")
    monkeypatch.setattr(cache.numba.config, "CPU_FEATURES", "")
    v4 = cache.target_features()
    assert v4["avx512f"] and not v4.get("avx512bf16")  # v4 does not promise AVX512-BF16
    monkeypatch.setattr(cache.numba.config, "CPU_FEATURES", "+avx512bf16")  # the x86-64-v4-bf16 level
    assert cache.target_features()["avx512bf16"] and cache.target_features()["avx512f"]
    monkeypatch.setattr(cache.numba.config, "CPU_FEATURES", "")
    monkeypatch.setattr(cache.numba.config, "CPU_NAME", "x86-64-v3")
    assert cache.target_features()["avx2"] and not cache.target_features().get("avx512f")
    monkeypatch.setattr(cache.numba.config, "CPU_NAME", "znver3")  # a Zen 3 as LLVM knows it: none promised
    assert cache.target_features() == {}
    name, features = cache.llvm_target("x86-64-v3-zen")  # the same CPU without what v3 lacks: the zen level
    monkeypatch.setattr(cache.numba.config, "CPU_NAME", name)
    monkeypatch.setattr(cache.numba.config, "CPU_FEATURES", features)
    zen = cache.target_features()
    assert zen["avx2"] and zen["sse4a"] and not zen.get("sha") and not zen.get("avx512f")
    monkeypatch.setattr(cache.numba.config, "CPU_NAME", None)
    assert cache.target_features() == dict(llvm.get_host_cpu_features())


def test_build_tiers_names_an_unknown_level(tmp_path):
    with pytest.raises(ValueError, match="x86-64-v3"):
        build_tiers.build("x86-64-v9", tmp_path)


# The bf16 kernels as an AVX2 CPU runs them (integer rounding, rows read and written in pairs),
# compiled for the x86-64-v3 level, on inputs saved by the test: outputs, then gradients of x.
AVX2_KERNELS = """
import sys, torch
import normlab
v = torch.load(sys.argv[1], weights_only=True)
x, r, w, w_inf, b, b_nan, x_past_k, w_zero, dy, dy_ln, ds = v.values()
F = dict(backend="cpu", eps=0.0)
out = {
    "rms llama": normlab.rms_norm(x, w, cast="llama", **F),
    "rms gemma offset": normlab.rms_norm(x, w, cast="gemma", offset=1.0, **F),
    "rms inf weight": normlab.rms_norm(x, w_inf, **F),
    "rms partial": normlab.rms_norm(x_past_k, w_zero, partial=0.5, **F),
    "add rms": normlab.add_rms_norm(x, r, w, **F)[0],
    "layer": normlab.layer_norm(x, w, b, **F),
    "layer inf weight": normlab.layer_norm(x, w_inf, b, **F),
    "layer nan bias": normlab.layer_norm(x, w, b_nan, **F),
    "add layer": normlab.add_layer_norm(x, r, w, b, **F)[0],
}


def grad(f, upstream=(dy,)):
    leaf = x.clone().requires_grad_()
    outs = f(leaf)
    return torch.autograd.grad(outs if isinstance(outs, tuple) else (outs,), leaf, upstream)[0]


grads = {
    "rms llama": grad(lambda t: normlab.rms_norm(t, w, cast="llama", **F)),
    "rms gemma offset": grad(lambda t: normlab.rms_norm(t, w, cast="gemma", offset=1.0, **F)),
    "rms partial": grad(lambda t: normlab.rms_norm(t, w, partial=0.5, **F)),
    "rms outside": grad(lambda t: normlab.rms_norm(t, w, **dict(F, eps=1e-5), eps_mode="outside")),
    "add rms": grad(lambda t: normlab.add_rms_norm(t, r, w, **F), (dy, ds)),
    "layer": grad(lambda t: normlab.layer_norm(t, w, b, **F), (dy_ln,)),
    "add layer": grad(lambda t: normlab.add_layer_norm(t, r, w, b, **F), (dy_ln, ds)),
}
torch.save({"out": out, "grads": grads}, sys.argv[2])
"""


@pytest.mark.skipif(not V3_HOST, reason="loading an x86-64-v3 tier needs a CPU with AVX2 (an x86-64-v3 CPU)")
def test_the_avx2_bf16_kernels_give_nan_where_the_math_does_and_torchs_nan_bits(tmp_path, gen):
    # Where bf16 is rounded with integer arithmetic, a nan needs a select to come out as torch's
    # quiet nan (0x7FC0); the kernels skip it on rows rows.nan_free (forwards) or
    # rows.grad_nan_free (backwards) proves free of nan. Each row here is a way to make one (a
    # nan or an inf in x or dy, a zero row with eps = 0, an inf weight times a zero, a nan bias,
    # an inf past partial RMSNorm's statistic times a zero weight): the results must be nan
    # exactly where the float64 math is, every nan 0x7FC0, the rest in bound. The host's own
    # kernels cannot show this on a CPU with AVX512-BF16, hence the level's code.
    d = 1024  # whole paired blocks
    x = torch.randn(8, d, generator=gen)
    # squares within float32
    x[1, 5], x[2, 7], x[3], x[4], x[5] = math.nan, math.inf, 0.0, x[4] * 1e15, x[5] * 1e-15
    x[0, 9] = 0.0  # times w_inf's inf
    w, b, r = torch.randn(d, generator=gen), torch.randn(d, generator=gen), torch.randn(8, d, generator=gen)
    w_inf, b_nan, w_zero, x_past_k = w.clone(), b.clone(), w.clone(), x.clone()
    w_inf[9], b_nan[11], w_zero[900], x_past_k[6, 900] = math.inf, math.nan, 0.0, math.inf
    dy, ds = torch.randn(8, d, generator=gen), torch.randn(8, d, generator=gen)
    dy_ln = dy.clone()
    # not for LayerNorm: whether its dx is then inf or nan depends on the formula and the row
    dy[6, 3] = math.inf
    tensors = dict(x=x, r=r, w=w, w_inf=w_inf, b=b, b_nan=b_nan, x_past_k=x_past_k, w_zero=w_zero, dy=dy,
                   dy_ln=dy_ln, ds=ds)
    inputs = {k: v.bfloat16() for k, v in tensors.items()}
    # Negative nans (0xFFC0), which torch's conversion does not make; rounded without the select
    # their bits would stay so. Row 0's sums are finite, so only ds, which no sum of pass 1 reads,
    # puts a nan in its gradient. Row 3 is zeros: with eps outside the root its coefficient is 0
    # whatever its nan sum (rmsnorm._rms_coef), so only the sum shows the nan in dy.
    for name, at in (("dy", (7, 4)), ("dy_ln", (7, 4)), ("dy", (3, 6)), ("ds", (0, 2))):
        inputs[name].view(torch.int16)[at] = -64
    torch.save(inputs, tmp_path / "in.pt")
    cpu_name, features = cache.llvm_target("x86-64-v3")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "NORMLAB_CPU_TIERS": "off",
           "NUMBA_CPU_NAME": cpu_name,
           "NUMBA_CPU_FEATURES": features}
    run = subprocess.run([sys.executable, "-c", AVX2_KERNELS, str(tmp_path / "in.pt"),
                          str(tmp_path / "out.pt")], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    import normlab

    v = {k: t.double() for k, t in inputs.items()}
    s = (inputs["x"] + inputs["r"]).double()  # the residual sum as the add variants round it
    F = dict(backend="reference", eps=0.0)
    truth = {
        "rms llama": normlab.rms_norm(v["x"], v["w"], cast="llama", **F),
        "rms gemma offset": normlab.rms_norm(v["x"], v["w"], cast="gemma", offset=1.0, **F),
        "rms inf weight": normlab.rms_norm(v["x"], v["w_inf"], **F),
        "rms partial": normlab.rms_norm(v["x_past_k"], v["w_zero"], partial=0.5, **F),
        "add rms": normlab.rms_norm(s, v["w"], **F),
        "layer": normlab.layer_norm(v["x"], v["w"], v["b"], **F),
        "layer inf weight": normlab.layer_norm(v["x"], v["w_inf"], v["b"], **F),
        "layer nan bias": normlab.layer_norm(v["x"], v["w"], v["b_nan"], **F),
        "add layer": normlab.layer_norm(s, v["w"], v["b"], **F),
    }

    def grad(f, at, extra=0.0, dy="dy"):
        leaf = at.clone().requires_grad_()
        return torch.autograd.grad(f(leaf), leaf, v[dy])[0] + extra

    grads = {
        "rms llama": grad(lambda t: normlab.rms_norm(t, v["w"], cast="llama", **F), v["x"]),
        "rms gemma offset": grad(lambda t: normlab.rms_norm(t, v["w"], cast="gemma", offset=1.0, **F),
                                 v["x"]),
        "rms partial": grad(lambda t: normlab.rms_norm(t, v["w"], partial=0.5, **F), v["x"]),
        "rms outside": grad(lambda t: normlab.rms_norm(t, v["w"], **dict(F, eps=1e-5), eps_mode="outside"),
                            v["x"]),
        "add rms": grad(lambda t: normlab.rms_norm(t, v["w"], **F), s, v["ds"]),
        "layer": grad(lambda t: normlab.layer_norm(t, v["w"], v["b"], **F), v["x"], dy="dy_ln"),
        "add layer": grad(lambda t: normlab.layer_norm(t, v["w"], v["b"], **F), s, v["ds"], dy="dy_ln"),
    }
    for kind, want_all in (("out", truth), ("grads", grads)):
        for name, want in want_all.items():
            y = got[kind][name]
            nan = torch.isnan(want)
            assert nan.any() and torch.equal(torch.isnan(y), nan), (
                f"{kind} {name}: nan at {torch.isnan(y).sum()} places, not {nan.sum()}"
            )
            assert (y[nan].view(torch.int16) == 0x7FC0).all(), (
                f"{kind} {name}: a nan that is not torch's quiet nan"
            )
            assert_close(y[~nan], want[~nan], name=f"{kind} {name}")
