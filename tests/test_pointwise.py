"""The point-wise replacements of a norm, DyT (Zhu et al. 2025), weight * tanh(alpha * x) + bias,
and Derf (Chen et al. 2025), weight * erf(alpha * x + shift) + bias: every backend against the
float64 reference, outputs and the gradients of x, alpha, shift, weight and bias, on odd sizes,
zeros, large (saturating) values, non-finite rows and non-contiguous inputs; deterministic
gradients; the modules, build_norm, the model and torch.compile. Both run through the same
kernels (kernels/cpu/pointwise.py), so the kernel tests take each in turn (``fn``)."""

import importlib
import math

import numpy as np
import pytest
import torch

from normlab import functional as F
from normlab import reference
from normlab.model import Decoder, ModelConfig
from normlab.nn import Derf, DyT, build_norm
from normlab.testing import assert_close

# minutes cold on 2 cores; in-process compiles, run on one worker (conftest.py)
pytestmark = [pytest.mark.slow(minutes=1), pytest.mark.xdist_group("kernels")]
pytest.importorskip("numba", reason="the cpu backend needs numba")
K = importlib.import_module("normlab.kernels.cpu.pointwise")
TE = importlib.import_module("normlab.kernels.cpu.tanh_erf")
STAGE_WIDTH = importlib.import_module("normlab.kernels.cpu.simd").STAGE_WIDTH


def _at(a: np.ndarray) -> tuple:
    """A numpy array as the (address, shape, dtype witness) triple the launchers pass (launch._at),
    so that calls made here use the launchers' compiled signatures. ``a`` must stay referenced."""
    return a.ctypes.data, a.shape, np.empty(0, a.dtype)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# 16-bit inputs from DYT_TABLE_MIN elements gather tanh from a table (K.TABLES): the
# adversarial tests run each 16-bit dtype both ways, the table forced on at any size
PATHS = [(torch.float32, False)] + [(dtype, tables) for dtype in DTYPES[1:] for tables in (False, True)]


def use_tables(monkeypatch, on):
    monkeypatch.setattr(K, "DYT_TABLE_MIN", 0 if on else 1 << 62)


FNS = ["dyt", "derf"]
SATURATES = {"dyt": 10.0, "derf": 6.0}  # |z| from which the kernels' backward passes nothing to x


def _z(leaves):
    z = leaves["alpha"].double() * leaves["x"].double()
    return z + leaves["shift"].double() if "shift" in leaves else z


def _slope(leaves):
    """f'(z) in float64."""
    z = _z(leaves)
    return 2 / math.sqrt(math.pi) * torch.exp(-z * z) if "shift" in leaves else 1 - torch.tanh(z) ** 2


def _leaves(gen, shape, dtype, *, scale=1.0, affine=True, alpha=0.7, fn="dyt", shift=0.3):
    d = shape[-1]
    leaves = {"x": (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype),
              "alpha": torch.tensor([alpha], dtype=torch.float32)}
    if fn == "derf":
        leaves["shift"] = torch.tensor([shift], dtype=torch.float32)
    if affine:
        leaves["weight"] = (1 + 0.5 * torch.randn(d, generator=gen, dtype=torch.float64)).to(dtype)
        leaves["bias"] = (0.5 * torch.randn(d, generator=gen, dtype=torch.float64)).to(dtype)
    return leaves


def _call(leaves, backend):
    scalars = [leaves["alpha"]] + ([leaves["shift"]] if "shift" in leaves else [])
    fn = F.derf if "shift" in leaves else F.dyt
    return fn(leaves["x"], *scalars, leaves.get("weight"), leaves.get("bias"), backend=backend)


def _run(leaves, backend, dy, convert=None):
    leaves = {k: (convert(v) if convert else v.clone()).requires_grad_() for k, v in leaves.items()}
    y = _call(leaves, backend)
    grads = torch.autograd.grad(y, list(leaves.values()), dy.to(y.dtype))
    return y, dict(zip(leaves, grads))


def check(gen, shape, dtype, backend="cpu", leaves=None, **kw):
    leaves = leaves or _leaves(gen, shape, dtype, **kw)
    dy = torch.randn(leaves["x"].shape, generator=gen, dtype=torch.float64).to(dtype)
    fast, fast_g = _run(leaves, backend, dy)
    lowp, lowp_g = _run(leaves, "reference", dy)
    truth, truth_g = _run(leaves, "reference", dy, convert=lambda t: t.double())
    assert fast.dtype == dtype and fast.shape == leaves["x"].shape
    assert_close(fast, truth, lowp=lowp, dtype=dtype, name="output")
    # dalpha sums u * x over every element (dshift sums u), with cancellation: floating point
    # bounds its error relative to the sum of the terms' sizes, not to the (much smaller) sum itself
    w64 = leaves["weight"].double() if "weight" in leaves else 1.0
    u = dy.double() * w64 * _slope(leaves)
    terms = {"alpha": (u * leaves["x"].double()).abs().sum().reshape(1), "shift": u.abs().sum().reshape(1)}
    for name in fast_g:
        rule = "row" if name == "x" else "tensor"
        assert_close(fast_g[name], truth_g[name], lowp=lowp_g[name], dtype=leaves[name].dtype,
                     name=f"d{name}", rule=rule,
                     magnitude=terms.get(name))
    return fast, fast_g


@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("dtype, tables", PATHS)
@pytest.mark.parametrize("d", [1, 3, 96, 123, 3000, 65537])  # 96, 123, 3000: a half block at the end
def test_matches_float64_at_odd_sizes(gen, fn, dtype, tables, d, monkeypatch):
    use_tables(monkeypatch, tables)
    check(gen, (5, d) if d < 60000 else (2, d), dtype, fn=fn)


@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("dtype, tables", PATHS)
@pytest.mark.parametrize("scale, alpha, shift",
                         [(1e-6, 0.5, 0.0), (1e-6, 0.5, 1e-7), (30.0, 0.5, -0.4), (1e4, 2.0, 0.3),
                          (1.0, 1e-3, 0.3), (1.0, 0.8, 2.5)])
def test_tiny_and_saturating_inputs(gen, fn, dtype, tables, scale, alpha, shift, monkeypatch):
    use_tables(monkeypatch, tables)
    leaves = _leaves(gen, (6, 257), dtype, scale=scale, alpha=alpha, fn=fn, shift=shift)
    y, g = check(gen, None, dtype, leaves=leaves)
    saturated = _z(leaves).abs() >= SATURATES[fn]  # f is +-1 there, so nothing flows to x
    assert torch.all(g["x"][saturated] == 0)
    assert saturated.float().mean() > (0.9 if scale * alpha >= 1e3 else -1)


@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("dtype, tables", PATHS)
def test_zero_rows_weightless_and_affine(gen, fn, dtype, tables, monkeypatch):
    use_tables(monkeypatch, tables)
    leaves = _leaves(gen, (4, 130), dtype, fn=fn)
    leaves["x"][1] = 0
    check(gen, None, dtype, leaves=leaves)
    check(gen, (4, 130), dtype, affine=False, fn=fn)


@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("dtype, tables", PATHS)
def test_non_finite_rows_stay_in_their_row(gen, fn, dtype, tables, monkeypatch):
    use_tables(monkeypatch, tables)
    x = torch.randn(5, 200, generator=gen).to(dtype)
    x[1, 7], x[3, 0] = float("nan"), float("inf")
    leaves = {"x": x.requires_grad_(), "alpha": torch.tensor([0.5]), "weight": torch.ones(200, dtype=dtype),
              "bias": torch.zeros(200, dtype=dtype)}
    if fn == "derf":
        leaves["shift"] = torch.tensor([0.25])
    y = _call(leaves, "cpu")
    ref = _call({k: v.detach() for k, v in leaves.items()}, "reference")
    assert torch.isnan(y[1, 7]) and y[3, 0] == 1  # tanh(inf) = erf(inf) = 1
    finite = torch.ones(5, 200, dtype=torch.bool)
    finite[1, 7] = False
    assert torch.equal(torch.isfinite(y), finite)
    assert torch.allclose(y[finite].float(), ref[finite].float(), atol=2e-2 if dtype == torch.bfloat16
                          else 1e-6)
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert torch.isnan(dx[1, 7]) and torch.isfinite(dx[[0, 2, 4]]).all()


@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("dtype, tables", PATHS)
def test_non_contiguous_inputs(gen, fn, dtype, tables, monkeypatch):
    use_tables(monkeypatch, tables)
    big = torch.randn(6, 300, generator=gen).to(dtype)
    leaves = _leaves(gen, (6, 150), dtype, fn=fn)
    leaves["x"] = big[:, ::2]
    assert not leaves["x"].is_contiguous()
    check(gen, None, dtype, leaves=leaves)


@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("backend, shape", [("cpu", (257, 1000)), ("triton", (9, 40))])
def test_gradients_are_deterministic(gen, fn, backend, shape):
    leaves = _leaves(gen, shape, torch.float32, fn=fn)
    dy = torch.randn(*shape, generator=gen)
    first = _run(leaves, backend, dy)[1]
    for _ in range(3):
        again = _run(leaves, backend, dy)[1]
        assert all(torch.equal(first[k], again[k]) for k in first)


@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("dtype, tables", [path for path in PATHS if K.TABLES or not path[1]])
def test_a_row_pair_is_bitwise_two_single_rows(gen, fn, dtype, tables):
    # Wide rows go through the backward two at a time (_make_grad_blocks, rows=2): dx, the
    # partial rows and each row's dalpha and dshift sums must be the very bits of two one-row passes.
    from numba import njit

    one, two = K._GRAD_BLOCKS[1], K._GRAD_BLOCKS[2]
    s = None if fn == "dyt" else np.float32(0.3)

    @njit
    def single(dx, dx2, n, dy, x, dy2, x2, w, dwc, dbc, stage, a, s, table, use):
        (a1, s1), (a2, s2) = (one(dx, 0, n, dy, x, w, dwc, dbc, stage, a, s, False, table, use, False, 0),
                              one(dx2, 0, n, dy2, x2, w, dwc, dbc, stage, a, s, False, table, use, True, 0))
        return a1, a2, s1, s2

    @njit
    def pair(dx, dx2, n, dy, x, dy2, x2, w, dwc, dbc, stage, a, s, table, use):
        return two(dx, 0, n, dy, x, w, dwc, dbc, stage, a, s, False, table, use, dx2, dy2, x2, True, 0)

    memory = importlib.import_module("normlab.kernels.cpu.memory")
    d, n = 5 * 64 + 9, 5 * 64
    rows = [memory.as_numpy((torch.randn(d, generator=gen) * 2).to(dtype)) for _ in range(4)]
    w = torch.randn(d, generator=gen).numpy()
    start = torch.randn(2, d, generator=gen).numpy()  # partial rows that already hold sums
    stage = np.zeros(STAGE_WIDTH, np.float32)
    table = _filled_table(rows[1], 0.7, s, grad=True) if tables else np.empty(0, np.float32)
    results = []
    for run in (single, pair):
        part, dx = start.copy(), [np.zeros_like(rows[0]) for _ in range(2)]
        sums = run(dx[0], dx[1], n, *rows, w, part[0], part[1], stage, np.float32(0.7), s, table, tables)
        results.append((np.array(sums), part, np.stack(dx)))
    for a, b in zip(*results):
        assert a.tobytes() == b.tobytes()
    assert not np.array_equal(results[0][1][:, :n], start[:, :n])  # the terms were added
    # and nothing past n
    assert np.array_equal(results[0][1][:, n:], start[:, n:]) and not results[0][2][:, n:].any()
    assert (results[0][0][2:] != 0).all() == (fn == "derf")  # dshift's sums: Derf's alone


def _filled_table(x, a, s, grad):
    """A table for x's dtype as the kernels fill it (a one-row call fills it)."""
    assert K.TABLES, "no test asks for a table where the kernels would not use one"
    table = np.empty((2 if grad else 1) * K.TABLE_SIZE, np.float32)
    row, stages = x[None, :64].copy(), np.zeros((1, STAGE_WIDTH), np.float32)
    w, zero, out = np.ones(64, np.float32), np.zeros(64, np.float32), row.copy()
    if grad:
        K.pointwise_bwd(_at(row), _at(row), a, s, _at(w), _at(out), np.zeros((1, 2)), np.zeros((1, 64)),
                        np.zeros((1, 64)), stages, False, table, False, 0)
    else:
        K.pointwise_fwd(_at(row), a, s, _at(w), _at(zero), _at(out), stages, False, table, False, 0)
    return table


@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wide_rows_get_their_own_bits_in_pairs(gen, fn, dtype):
    # From DYT_PAIRS_MIN_* values a row, rows go in pairs (a chunk's odd row alone): gradients
    # against float64, and each row's dx bitwise what it gets alone (the single-row path).
    d = max(K.DYT_PAIRS_MIN_16, K.DYT_PAIRS_MIN_32) + 37
    leaves = _leaves(gen, (7, d), dtype, fn=fn)
    check(gen, None, dtype, leaves=leaves)
    dy = torch.randn(7, d, generator=gen).to(dtype)
    together = _run(leaves, "cpu", dy)[1]
    for r in (0, 3, 6):
        alone = _run({k: (v[r : r + 1] if k == "x" else v) for k, v in leaves.items()}, "cpu",
                     dy[r : r + 1])[1]
        assert torch.equal(together["x"][r : r + 1], alone["x"]), r


def test_tanh_and_its_derivative_against_float64():
    """The kernels' tanh within 2 ulp, and the backward's 1 - t^2 = 4h (1 - h) within 3e-7
    relative, on every 97th float32 from the least subnormal to 10.5, past saturation, every other
    one negated (the 16-lane blocks and the scalar tail). The worst ulp sits at odd spots: a
    sweep of every 256th float found an error the old test's 240,000 round numbers missed."""
    bits = np.arange(1, np.float32(10.5).view(np.int32), 97, dtype=np.int32)
    z = torch.from_numpy(bits.view(np.float32).copy())
    z[1::2] *= -1
    x = z.float().reshape(1, -1).numpy()
    y, dx = x.copy(), x.copy()
    one, zero, dy = np.ones(x.shape[1], np.float32), np.zeros(x.shape[1], np.float32), np.ones_like(x)
    stages = np.zeros((1, STAGE_WIDTH), np.float32)
    none = np.empty(0, np.float32)  # (float32: no table)
    K.pointwise_fwd(_at(x), 1.0, None, _at(one), _at(zero), _at(y), stages, False, none, False, 0)
    K.pointwise_bwd(_at(dy), _at(x), 1.0, None, _at(one), _at(dx), np.zeros((1, 2)),
                    np.zeros((1, x.shape[1])), np.zeros((1, x.shape[1])), stages, False, none, False, 0)
    z64 = z.float().double()
    exact = torch.tanh(z64)
    ulp = torch.from_numpy(np.spacing(exact.abs().float().numpy())).double()
    err = (torch.from_numpy(y[0]).double() - exact).abs() / ulp
    assert err.max() <= 2.0, err.max()
    assert torch.all(torch.from_numpy(y[0])[exact.float().abs() == 1].abs() == 1)  # +-1 where float32 tanh is
    sech2 = 1 / torch.cosh(z64) ** 2
    inside = z64.abs() < 10
    rel = (torch.from_numpy(dx[0]).double() - sech2).abs()[inside] / sech2[inside]
    assert rel.max() <= 3e-7, rel.max()
    assert torch.all(torch.from_numpy(dx[0])[~inside] == 0)


def test_erf_and_its_derivative_against_float64():
    """The kernels' erf within 1.5 ulp (float32's own erf: about 1; every float32: 1.04) and the
    backward's erf'(z) within 3e-7 relative, on every 97th float32 from the least subnormal to 6.5, past
    saturation, every other one negated (the 16-lane blocks and the scalar tail), with shift 0;
    erf'(z) is 0 from |z| = 6 on, where it is below 1e-15."""
    from scipy.special import erf

    bits = np.arange(1, np.float32(6.5).view(np.int32), 97, dtype=np.int32)
    z = bits.view(np.float32).copy()
    z[1::2] *= -1
    x = z.reshape(1, -1)
    y, dx = x.copy(), x.copy()
    one, zero, dy = np.ones(x.shape[1], np.float32), np.zeros(x.shape[1], np.float32), np.ones_like(x)
    stages = np.zeros((1, STAGE_WIDTH), np.float32)
    none = np.empty(0, np.float32)
    K.pointwise_fwd(_at(x), 1.0, np.float32(0.0), _at(one), _at(zero), _at(y), stages, False, none, False, 0)
    K.pointwise_bwd(_at(dy), _at(x), 1.0, np.float32(0.0), _at(one), _at(dx), np.zeros((1, 2)),
                    np.zeros((1, x.shape[1])), np.zeros((1, x.shape[1])), stages, False, none, True, 0)
    z64 = z.astype(np.float64)
    exact = erf(z64)
    ulp = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    err = np.abs(y[0] - exact) / ulp
    assert err.max() <= 1.5, (err.max(), z[err.argmax()])
    # +-1 from 3.92 on (float32's erf is from 3.9192: in between, 1 - 2^-24, one ulp off)
    assert np.all(np.abs(y[0][np.abs(z64) >= 3.92]) == 1)
    slope = 2 / np.sqrt(np.pi) * np.exp(-z64 * z64)
    inside = np.abs(z64) < 6
    rel = np.abs(dx[0] - slope)[inside] / slope[inside]
    assert rel.max() <= 3e-7, (rel.max(), z[inside][rel.argmax()])
    assert np.all(dx[0][~inside] == 0)


@pytest.mark.parametrize("fn", FNS)
def test_float64_gradcheck(fn):
    x = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    scalars = [torch.tensor([v], dtype=torch.float64, requires_grad=True)
               for v in ((0.6,) if fn == "dyt" else (0.6, 0.2))]
    params = (torch.randn(7, dtype=torch.float64, requires_grad=True),
              torch.randn(7, dtype=torch.float64, requires_grad=True))
    assert torch.autograd.gradcheck(lambda *a: getattr(F, fn)(*a, backend="cpu"), (x, *scalars, *params))


def test_derf_module_and_build_norm():
    m = build_norm("derf", 64, alpha0=0.2, shift0=0.1)
    assert isinstance(m,
                      Derf) and m.alpha.item() == pytest.approx(0.2) and m.shift.item() == pytest.approx(0.1)
    assert sorted(n for n, _ in m.named_parameters()) == ["alpha", "bias", "shift", "weight"]
    x = torch.randn(2, 3, 64)
    assert torch.allclose(m(x), reference.derf(x, m.alpha, m.shift, m.weight, m.bias))
    assert build_norm("derf", 8).shift.item() == 0.0 and build_norm("derf", 8, weightless=True).weight is None
    assert "shift0=0.1" in repr(m)
    with pytest.raises(ValueError, match="shift0 must be a finite number"):
        Derf(8, shift0=float("nan"))
    with pytest.raises(ValueError, match="alpha0 must be a finite number > 0 \\(Derf's"):
        Derf(8, alpha0=-1.0)
    with pytest.raises(ValueError, match="shift must be a floating-point tensor of one element"):
        F.derf(x, torch.ones(1), torch.ones(2))
    with pytest.raises(ValueError, match="unknown option\\(s\\) eps for norm kind 'derf'"):
        build_norm("derf", 8, eps=1e-5)


def test_compiled_derf_matches_eager(gen):
    m = Derf(96, alpha0=0.8, shift0=0.2, backend="cpu")
    x = torch.randn(4, 96, generator=gen, requires_grad=True)
    eager = m(x)
    g_eager = torch.autograd.grad(eager.sum(), (m.alpha, m.shift))
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    out = compiled(x)
    g_compiled = torch.autograd.grad(out.sum(), (m.alpha, m.shift))
    assert torch.equal(out, eager) and all(torch.equal(a, b) for a, b in zip(g_compiled, g_eager))


def test_derf_gradient_penalty_matches_the_reference(gen):
    # create_graph=True takes the reference's differentiable math: a second derivative exists
    leaves = {k: v.requires_grad_() for k, v in _leaves(gen, (3, 40), torch.float32, fn="derf").items()}
    results = []
    for backend in ("cpu", "reference"):
        y = _call(leaves, backend)
        (gx,) = torch.autograd.grad(y.square().sum(), leaves["x"], create_graph=True)
        results.append(torch.autograd.grad(gx.square().sum(), [leaves["alpha"], leaves["shift"]]))
    for a, b in zip(*results):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_the_module_and_build_norm():
    m = build_norm("dyt", 64, alpha0=0.2)
    assert isinstance(m, DyT) and m.alpha.shape == (1,) and m.alpha.item() == pytest.approx(0.2)
    # the paper's module's names
    assert sorted(n for n, _ in m.named_parameters()) == ["alpha", "bias", "weight"]
    x = torch.randn(2, 3, 64)
    assert torch.allclose(m(x), reference.dyt(x, m.alpha, m.weight, m.bias))
    assert build_norm("dyt", 8, weightless=True).weight is None
    with pytest.raises(ValueError, match="alpha0 must be a finite number > 0"):
        DyT(8, alpha0=0.0)
    with pytest.raises(ValueError, match="unknown option\\(s\\) eps for norm kind 'dyt'"):
        build_norm("dyt", 8, eps=1e-5)
    with pytest.raises(ValueError, match="alpha must be a floating-point tensor of one element"):
        F.dyt(x, torch.ones(2))


def test_compiled_dyt_matches_eager(gen):
    m = DyT(96, alpha0=0.8, backend="cpu")
    x = torch.randn(4, 96, generator=gen, requires_grad=True)
    eager = m(x)
    (g_eager,) = torch.autograd.grad(eager.sum(), m.alpha)
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    out = compiled(x)
    (g_compiled,) = torch.autograd.grad(out.sum(), m.alpha)
    assert torch.equal(out, eager) and torch.equal(g_compiled, g_eager)


@pytest.mark.parametrize("fn, module", [("dyt", DyT), ("derf", Derf)])
def test_a_pointwise_model_has_no_norm_and_trains(gen, fn, module):
    cfg = ModelConfig.preset("tiny", norm=fn, dyt_alpha0=0.3, backend="cpu")
    torch.manual_seed(0)
    model = Decoder(cfg)
    found = [m for m in model.modules() if isinstance(m, module)]
    assert found and all(m.alpha.item() == pytest.approx(0.3) for m in found)
    assert not any(isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm)) for m in model.modules())
    tokens = torch.randint(0, cfg.vocab_size, (4, 17), generator=gen)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(12):
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, losses  # twelve steps on one batch: it learns
    if fn == "derf":
        assert all(m.shift.grad is not None and m.shift.grad.abs() > 0 for m in found)  # the shift trains too
    with pytest.raises(ValueError, match="dyt_alpha0 must be a finite number > 0"):
        ModelConfig.preset("tiny", norm=fn, dyt_alpha0=-1.0)


# ---------------------------------------------------------------- the Triton kernels (interpreter)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1, 3, 123, 3000])
def test_triton_matches_float64(gen, dtype, d):
    pytest.importorskip("triton")
    check(gen, (3, d), dtype, backend="triton")


def test_triton_edge_cases(gen, monkeypatch):
    pytest.importorskip("triton")
    from normlab.kernels.triton import launch as T
    for dtype in (torch.float32, torch.bfloat16):
        check(gen, (4, 33), dtype, backend="triton", scale=1e4, alpha=2.0)  # saturated
        check(gen, (4, 33), dtype, backend="triton", affine=False)
        leaves = _leaves(gen, (4, 33), dtype)
        leaves["x"] = torch.randn(4, 66, generator=gen).to(dtype)[:, ::2]  # non-contiguous
        check(gen, None, dtype, backend="triton", leaves=leaves)
    monkeypatch.setattr(T, "MAX_BLOCK", 16)  # 100 columns: 7 column blocks, the last one partial
    check(gen, (5, 100), torch.float32, backend="triton")
    x = torch.randn(3, 20, generator=gen)
    x[1, 3] = float("nan")
    y = F.dyt(x, torch.tensor([0.5]), backend="triton")
    assert torch.isnan(y[1, 3]) and torch.isfinite(y[[0, 2]]).all() and torch.isfinite(y[1, :3]).all()


def _one_lane(body):
    """A jitted function of a float32 array that runs ``body`` (16-lane IR) on each value."""
    from numba import njit, types
    from numba.extending import intrinsic

    @intrinsic
    def op(typingctx, v):
        def codegen(context, builder, signature, args):
            return K._lane0(context, builder, signature, args, body)

        return types.float32(types.float32), codegen

    return njit(lambda vs: [op(v) for v in vs])


def test_both_forms_of_two_to_the_n_are_exact():
    """pow2 gives 2^n and 2^(n + 1) by AVX-512's vscalefps or by building the float32 bits (other
    CPUs): both exact over the n that tanh's reduction makes, so a kernel's bits do not depend
    on which (tanh's n run down to -29, Derf's exp(-z^2) to -52)."""
    ns = np.arange(-52, 1, dtype=np.float32)
    for scale in (1, 2):
        for scalef in (False, True) if TE.AVX512 else (False,):
            got = _one_lane(lambda b, v: TE.pow2(b, v, scale, scalef=scalef))(ns)
            assert np.array_equal(np.array(got), np.ldexp(np.float32(scale),
                                                          ns.astype(int)).astype(np.float32)), (scale, scalef)


@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1000, 2048])
@pytest.mark.parametrize("path", ["streaming stores", "prefetch into L2"])
def test_each_memory_path_gives_the_same_bits(gen, fn, dtype, d, path, monkeypatch):
    # Outputs past half the last-level cache are written with non-temporal stores (16-bit ones
    # two vectors to a line, from a shared staging row's zeros): the values must be the plain
    # path's, bit for bit, at rows that start off a 64-byte boundary (d = 1000) and at rows that
    # go in pairs (d = 2048), and the staging rows must stay zero. dalpha's terms are grouped by
    # the blocks, which start at the first aligned element when streaming: the same sum, rounded
    # in another order. Prefetching the next row into L2 instead of L1 changes no bit at all.
    launch = importlib.import_module("normlab.kernels.cpu.launch")
    memory = importlib.import_module("normlab.kernels.cpu.memory")
    leaves = _leaves(gen, (37, d), dtype, fn=fn)
    dy = torch.randn(37, d, generator=gen).to(dtype)
    runs = []
    for min_bytes in (1 << 62, 0):
        monkeypatch.setattr(*((launch, "STREAM_MIN_BYTES") if path == "streaming stores"
                              else (memory, "PREFETCH_L2_MIN_BYTES")),
                            min_bytes)
        runs.append(_run(leaves, "cpu", dy))
    (plain, plain_g), (streamed, streamed_g) = runs
    assert torch.equal(plain, streamed)
    grouped = ("alpha", "shift") if path == "streaming stores" else ()
    assert all(torch.equal(plain_g[k], streamed_g[k]) for k in plain_g if k not in grouped)
    u = dy.double() * leaves["weight"].double() * _slope(leaves)
    terms = {"alpha": (u * leaves["x"].double()).abs().sum(), "shift": u.abs().sum()}
    for k in terms.keys() & plain_g.keys():
        assert (plain_g[k].double() - streamed_g[k].double()).abs() <= 1e-6 * terms[k], k
    assert not memory.zero_stages(launch.nchunks(37, 1 << 30)).any()


@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_small_call_on_one_thread_matches_the_chunked_call(gen, fn, dtype, monkeypatch):
    # Below SERIAL_MAX_BYTES a call runs as one chunk on the calling thread. Rows do not depend
    # on each other, so y and dx keep their bits (rows in pairs included: d = 2048); the
    # per-chunk sums of dalpha, dw and db are added over one chunk instead of several, so those
    # are checked against float64.
    launch = importlib.import_module("normlab.kernels.cpu.launch")
    leaves = _leaves(gen, (37, 2048), dtype, fn=fn)
    dy = torch.randn(37, 2048, generator=gen).to(dtype)
    runs = []
    for limit in (0, 1 << 30):
        monkeypatch.setattr(launch, "SERIAL_MAX_BYTES", limit)
        runs.append(_run(leaves, "cpu", dy))
        assert launch.nchunks(37, 37 * 2048 * 4) == (1 if limit else min(37, torch.get_num_threads()))
    (chunked, chunked_g), (one, one_g) = runs
    assert torch.equal(chunked, one) and torch.equal(chunked_g["x"], one_g["x"])
    check(gen, (37, 2048), dtype, leaves=leaves, fn=fn)  # still under the one-thread limit


@pytest.mark.skipif(not K.TABLES,
                    reason="no tables here (no AVX-512, or slow gathers): 16-bit inputs compute tanh")
@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d, stream", [(1024, False), (300, False), (2048, True)])
def test_tables_give_the_bits_of_computing(gen, fn, dtype, d, stream, monkeypatch):
    # A 16-bit input's tanh gathered from a table of all 65536 patterns (filled by the blocks'
    # own IR) must give the computed path's bits: every pattern (nan, inf, subnormals), then
    # finite values into saturation; rows in pairs (d = 1024, 2048), single with scalar heads
    # and tails (d = 300), and streamed (whose blocks start off the row's start).
    launch = importlib.import_module("normlab.kernels.cpu.launch")
    monkeypatch.setattr(launch, "STREAM_MIN_BYTES", 0 if stream else 1 << 62)
    monkeypatch.setattr(K, "FORWARD_TABLES", True)  # the forward's table too, where this CPU computes
    sizes = []

    def spy(x, grad):
        table = K.table_for(x, grad)
        sizes.append(table.size)
        return table

    monkeypatch.setattr(launch, "table_for", spy)
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int16).view(dtype)
    inputs = [every[torch.randperm(every.numel(), generator=gen)][: every.numel() // d * d].reshape(-1, d),
              (torch.randn(96, d, generator=gen) * 8).to(dtype)]
    for x in inputs:
        leaves = {"x": x, "alpha": torch.tensor([0.7]), "weight": torch.randn(d, generator=gen).to(dtype),
                  "bias": torch.randn(d, generator=gen).to(dtype)}
        if fn == "derf":
            leaves["shift"] = torch.tensor([-0.3])
        dy = torch.randn(x.shape, generator=gen).to(dtype)
        runs = []
        for on in (False, True):
            use_tables(monkeypatch, on)
            sizes.clear()
            runs.append(_run(leaves, "cpu", dy))
            # the kernels were given the tables
            assert sizes == ([K.TABLE_SIZE, 2 * K.TABLE_SIZE] if on else [0, 0])
        (y, g), (ty, tg) = runs
        assert torch.equal(y.view(torch.int16), ty.view(torch.int16))
        for k in g:
            assert g[k].view(torch.int32 if g[k].dtype == torch.float32 else torch.int16).equal(
                tg[k].view(torch.int32 if tg[k].dtype == torch.float32 else torch.int16)), k
    # the finite input's sums are compared too
    assert torch.isfinite(g["alpha"]) and torch.isfinite(g["weight"]).all()


def test_the_forward_computes_where_its_gathers_cost_more(monkeypatch):
    # A Zen 4's forward computes tanh (its gathers cost more), its backward still gathers; other
    # CPUs with tables gather in both.
    names = ("znver4", "znver5", "sapphirerapids", "icelake-server")
    assert [K.forward_tables(name) for name in names] == [False, True, True, True]
    x = np.empty((K.DYT_TABLE_MIN // 64, 128), np.uint16)  # a bf16 input as the kernels see it
    for tables, forward in ((True, False), (True, True), (False, True)):
        monkeypatch.setattr(K, "TABLES", tables)
        monkeypatch.setattr(K, "FORWARD_TABLES", tables and forward)
        sizes = K.table_for(x, grad=False).size, K.table_for(x, grad=True).size
        assert sizes == (K.TABLE_SIZE if tables and forward else 0, 2 * K.TABLE_SIZE if tables else 0)


def test_tables_only_where_gathers_are_fast(tmp_path):
    # Linux's report of the Gather Data Sampling mitigation, which makes gathers slow: no tables
    status = tmp_path / "gather_data_sampling"
    for text, fast in (("Mitigation: Microcode\n", False), ("Not affected\n", True), ("Vulnerable\n", True)):
        status.write_text(text)
        assert K.gathers_are_fast(str(status)) is fast, text
    assert K.gathers_are_fast(str(tmp_path / "absent")) is True
