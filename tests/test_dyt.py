"""DyT (Zhu et al. 2025), weight * tanh(alpha * x) + bias: every backend against the float64
reference, outputs and the gradients of x, alpha, weight and bias, on odd sizes, zeros, large
(saturating) values, non-finite rows and non-contiguous inputs; deterministic gradients; the
module, build_norm, the model and torch.compile."""

import importlib

import numpy as np
import pytest
import torch

from normlab import functional as F
from normlab import reference
from normlab.model import Decoder, ModelConfig
from normlab.nn import DyT, build_norm
from normlab.testing import assert_close

pytest.importorskip("numba", reason="the cpu backend needs numba")
K = importlib.import_module("normlab.kernels.cpu.dynamic_tanh")
STAGE_WIDTH = importlib.import_module("normlab.kernels.cpu.simd").STAGE_WIDTH

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# 16-bit inputs from DYT_TABLE_MIN elements gather tanh from a table (K.TABLES): the
# adversarial tests run each 16-bit dtype both ways, the table forced on at any size
PATHS = [(torch.float32, False)] + [(dtype, tables) for dtype in DTYPES[1:] for tables in (False, True)]


def use_tables(monkeypatch, on):
    monkeypatch.setattr(K, "DYT_TABLE_MIN", 0 if on else 1 << 62)


def _leaves(gen, shape, dtype, *, scale=1.0, affine=True, alpha=0.7):
    d = shape[-1]
    leaves = {"x": (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype),
              "alpha": torch.tensor([alpha], dtype=torch.float32)}
    if affine:
        leaves["weight"] = (1 + 0.5 * torch.randn(d, generator=gen, dtype=torch.float64)).to(dtype)
        leaves["bias"] = (0.5 * torch.randn(d, generator=gen, dtype=torch.float64)).to(dtype)
    return leaves


def _run(leaves, backend, dy, convert=None):
    leaves = {k: (convert(v) if convert else v.clone()).requires_grad_() for k, v in leaves.items()}
    y = F.dyt(leaves["x"], leaves["alpha"], leaves.get("weight"), leaves.get("bias"), backend=backend)
    grads = torch.autograd.grad(y, list(leaves.values()), dy.to(y.dtype))
    return y, dict(zip(leaves, grads))


def check(gen, shape, dtype, backend="cpu", leaves=None, **kw):
    leaves = leaves or _leaves(gen, shape, dtype, **kw)
    dy = torch.randn(leaves["x"].shape, generator=gen, dtype=torch.float64).to(dtype)
    fast, fast_g = _run(leaves, backend, dy)
    lowp, lowp_g = _run(leaves, "reference", dy)
    truth, truth_g = _run(leaves, "reference", dy, convert=lambda t: t.double())
    assert fast.dtype == dtype and fast.shape == leaves["x"].shape
    assert_close(fast, truth, lowp=lowp, dtype=dtype, name="dyt output")
    # dalpha sums u * x over every element, with cancellation: floating point bounds its error
    # relative to the sum of the terms' sizes, not to the (much smaller) sum itself
    x64, a64 = leaves["x"].double(), leaves["alpha"].double()
    w64 = leaves["weight"].double() if "weight" in leaves else 1.0
    terms = (dy.double() * w64 * (1 - torch.tanh(a64 * x64) ** 2) * x64).abs().sum().reshape(1)
    for name in fast_g:
        rule = "row" if name == "x" else "tensor"
        assert_close(fast_g[name], truth_g[name], lowp=lowp_g[name], dtype=leaves[name].dtype, name=f"dyt d{name}", rule=rule,
                     magnitude=terms if name == "alpha" else None)
    return fast, fast_g


@pytest.mark.parametrize("dtype, tables", PATHS)
@pytest.mark.parametrize("d", [1, 3, 123, 3000, 65537])
def test_matches_float64_at_odd_sizes(gen, dtype, tables, d, monkeypatch):
    use_tables(monkeypatch, tables)
    check(gen, (5, d) if d < 60000 else (2, d), dtype)


@pytest.mark.parametrize("dtype, tables", PATHS)
@pytest.mark.parametrize("scale, alpha", [(1e-6, 0.5), (30.0, 0.5), (1e4, 2.0), (1.0, 1e-3)])
def test_tiny_and_saturating_inputs(gen, dtype, tables, scale, alpha, monkeypatch):
    use_tables(monkeypatch, tables)
    leaves = _leaves(gen, (6, 257), dtype, scale=scale, alpha=alpha)
    y, g = check(gen, None, dtype, leaves=leaves)
    saturated = (alpha * leaves["x"].double()).abs() >= 10  # tanh is +-1 there, so nothing flows to x
    assert torch.all(g["x"][saturated] == 0)
    assert saturated.float().mean() > (0.9 if scale * alpha >= 1e3 else -1)


@pytest.mark.parametrize("dtype, tables", PATHS)
def test_zero_rows_weightless_and_affine(gen, dtype, tables, monkeypatch):
    use_tables(monkeypatch, tables)
    leaves = _leaves(gen, (4, 130), dtype)
    leaves["x"][1] = 0
    check(gen, None, dtype, leaves=leaves)
    check(gen, (4, 130), dtype, affine=False)


@pytest.mark.parametrize("dtype, tables", PATHS)
def test_non_finite_rows_stay_in_their_row(gen, dtype, tables, monkeypatch):
    use_tables(monkeypatch, tables)
    x = torch.randn(5, 200, generator=gen).to(dtype)
    x[1, 7], x[3, 0] = float("nan"), float("inf")
    alpha, w, b = torch.tensor([0.5]), torch.ones(200, dtype=dtype), torch.zeros(200, dtype=dtype)
    y = F.dyt(x.requires_grad_(), alpha, w, b, backend="cpu")
    ref = reference.dyt(x.detach(), alpha, w, b)
    assert torch.isnan(y[1, 7]) and y[3, 0] == 1  # tanh(inf) = 1
    finite = torch.ones(5, 200, dtype=torch.bool)
    finite[1, 7] = False
    assert torch.equal(torch.isfinite(y), finite)
    assert torch.allclose(y[finite].float(), ref[finite].float(), atol=2e-2 if dtype == torch.bfloat16 else 1e-6)
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert torch.isnan(dx[1, 7]) and torch.isfinite(dx[[0, 2, 4]]).all()


@pytest.mark.parametrize("dtype, tables", PATHS)
def test_non_contiguous_inputs(gen, dtype, tables, monkeypatch):
    use_tables(monkeypatch, tables)
    big = torch.randn(6, 300, generator=gen).to(dtype)
    leaves = _leaves(gen, (6, 150), dtype)
    leaves["x"] = big[:, ::2]
    assert not leaves["x"].is_contiguous()
    check(gen, None, dtype, leaves=leaves)


@pytest.mark.parametrize("backend, shape", [("cpu", (257, 1000)), ("triton", (9, 40))])
def test_gradients_are_deterministic(gen, backend, shape):
    leaves = _leaves(gen, shape, torch.float32)
    dy = torch.randn(*shape, generator=gen)
    first = _run(leaves, backend, dy)[1]
    for _ in range(3):
        again = _run(leaves, backend, dy)[1]
        assert all(torch.equal(first[k], again[k]) for k in first)


@pytest.mark.parametrize("dtype, tables", [path for path in PATHS if K.TABLES or not path[1]])
def test_a_row_pair_is_bitwise_two_single_rows(gen, dtype, tables):
    # Wide rows go through the backward two at a time (_make_grad_blocks, rows=2): dx, the
    # partial rows and each row's dalpha sum must be the very bits of two one-row passes.
    from numba import njit

    one, two = K._GRAD_BLOCKS[1], K._GRAD_BLOCKS[2]

    @njit
    def single(dx, dx2, n, dy, x, dy2, x2, w, dwc, dbc, stage, a, table, use):
        return (one(dx, 0, n, dy, x, w, dwc, dbc, stage, a, False, table, use),
                one(dx2, 0, n, dy2, x2, w, dwc, dbc, stage, a, False, table, use))

    @njit
    def pair(dx, dx2, n, dy, x, dy2, x2, w, dwc, dbc, stage, a, table, use):
        return two(dx, 0, n, dy, x, w, dwc, dbc, stage, a, False, table, use, dx2, dy2, x2)

    memory = importlib.import_module("normlab.kernels.cpu.memory")
    d, n = 5 * 64 + 9, 5 * 64
    rows = [memory._as_numpy((torch.randn(d, generator=gen) * 2).to(dtype)) for _ in range(4)]
    w = torch.randn(d, generator=gen).numpy()
    start = torch.randn(2, d, generator=gen).numpy()  # partial rows that already hold sums
    stage = np.zeros(STAGE_WIDTH, np.float32)
    table = _filled_table(rows[1], 0.7, grad=True) if tables else np.empty(0, np.float32)
    results = []
    for run in (single, pair):
        part, dx = start.copy(), [np.zeros_like(rows[0]) for _ in range(2)]
        sums = run(dx[0], dx[1], n, *rows, w, part[0], part[1], stage, np.float32(0.7), table, tables)
        results.append((np.array(sums), part, np.stack(dx)))
    for a, b in zip(*results):
        assert a.tobytes() == b.tobytes()
    assert not np.array_equal(results[0][1][:, :n], start[:, :n])  # the terms were added
    assert np.array_equal(results[0][1][:, n:], start[:, n:]) and not results[0][2][:, n:].any()  # and nothing past n


def _filled_table(x, a, grad):
    """A table for x's dtype as the kernels fill it (a one-row call fills it)."""
    assert K.TABLES, "no test asks for a table where the kernels would not use one"
    table = np.empty((2 if grad else 1) * K.TABLE_SIZE, np.float32)
    row, stages = x[None, :64].copy(), np.zeros((1, STAGE_WIDTH), np.float32)
    w = np.ones(64, np.float32)
    if grad:
        K.dyt_bwd(row, row, a, w, row.copy(), np.zeros(1), np.zeros((1, 64)), np.zeros((1, 64)), stages, False, table)
    else:
        K.dyt_fwd(row, a, w, 0 * w, row.copy(), stages, False, table)
    return table


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wide_rows_get_their_own_bits_in_pairs(gen, dtype):
    # From DYT_PAIRS_MIN_* values a row, rows go in pairs (a chunk's odd row alone): gradients
    # against float64, and each row's dx bitwise what it gets alone (the single-row path).
    d = max(K.DYT_PAIRS_MIN_16, K.DYT_PAIRS_MIN_32) + 37
    leaves = _leaves(gen, (7, d), dtype)
    check(gen, None, dtype, leaves=leaves)
    dy = torch.randn(7, d, generator=gen).to(dtype)
    together = _run(leaves, "cpu", dy)[1]
    for r in (0, 3, 6):
        alone = _run({k: (v[r : r + 1] if k == "x" else v) for k, v in leaves.items()}, "cpu", dy[r : r + 1])[1]
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
    one = np.ones(x.shape[1], np.float32)
    stages = np.zeros((1, STAGE_WIDTH), np.float32)
    none = np.empty(0, np.float32)  # (float32: no table)
    K.dyt_fwd(x, 1.0, one, 0 * one, y, stages, False, none)
    K.dyt_bwd(np.ones_like(x), x, 1.0, one, dx, np.zeros(1), np.zeros((1, x.shape[1])), np.zeros((1, x.shape[1])), stages, False, none)
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


def test_float64_gradcheck():
    x = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    params = (torch.tensor([0.6], dtype=torch.float64, requires_grad=True), torch.randn(7, dtype=torch.float64, requires_grad=True),
              torch.randn(7, dtype=torch.float64, requires_grad=True))
    assert torch.autograd.gradcheck(lambda *a: F.dyt(*a, backend="cpu"), (x, *params))


def test_the_module_and_build_norm():
    m = build_norm("dyt", 64, alpha0=0.2)
    assert isinstance(m, DyT) and m.alpha.shape == (1,) and m.alpha.item() == pytest.approx(0.2)
    assert sorted(n for n, _ in m.named_parameters()) == ["alpha", "bias", "weight"]  # the paper's module's names
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


def test_a_dyt_model_has_no_norm_and_trains(gen):
    cfg = ModelConfig.preset("tiny", norm="dyt", dyt_alpha0=0.3)
    torch.manual_seed(0)
    model = Decoder(cfg)
    dyts = [m for m in model.modules() if isinstance(m, DyT)]
    assert dyts and all(m.alpha.item() == pytest.approx(0.3) for m in dyts)
    with pytest.raises(ValueError, match="dyt_alpha0 must be a finite number > 0"):
        ModelConfig.preset("tiny", norm="dyt", dyt_alpha0=-1.0)


# ---------------------------------------------------------------- the Triton kernels (interpreter)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1, 3, 123, 3000])
def test_triton_matches_float64(gen, dtype, d):
    pytest.importorskip("triton")
    check(gen, (3, d), dtype, backend="triton")


def test_triton_edge_cases(gen, monkeypatch):
    T = pytest.importorskip("normlab.kernels.triton")
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
    """_pow2 gives 2^n and 2^(n + 1) by AVX-512's vscalefps or by building the float32 bits (other
    CPUs): both exact over the n that tanh's reduction makes, so a kernel's bits do not depend
    on which."""
    ns = np.arange(-29, 1, dtype=np.float32)
    for scale in (1, 2):
        for scalef in (False, True) if K.AVX512 else (False,):
            got = _one_lane(lambda b, v: K._pow2(b, v, scale, scalef=scalef))(ns)
            assert np.array_equal(np.array(got), np.ldexp(np.float32(scale), ns.astype(int)).astype(np.float32)), (scale, scalef)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1000, 2048])
def test_streaming_stores_give_the_same_bits(gen, dtype, d, monkeypatch):
    # Outputs past half the last-level cache are written with non-temporal stores (16-bit ones
    # two vectors to a line, from a shared staging row's zeros): the values must be the plain
    # path's, bit for bit, at rows that start off a 64-byte boundary (d = 1000) and at rows that
    # go in pairs (d = 2048), and the staging rows must stay zero. dalpha's terms are grouped by
    # the blocks, which start at the first aligned element when streaming: the same sum, rounded
    # in another order.
    launch = importlib.import_module("normlab.kernels.cpu.launch")
    memory = importlib.import_module("normlab.kernels.cpu.memory")
    leaves = _leaves(gen, (37, d), dtype)
    dy = torch.randn(37, d, generator=gen).to(dtype)
    runs = []
    for min_bytes in (1 << 62, 0):
        monkeypatch.setattr(launch, "STREAM_MIN_BYTES", min_bytes)
        runs.append(_run(leaves, "cpu", dy))
    (plain, plain_g), (streamed, streamed_g) = runs
    assert torch.equal(plain, streamed)
    assert all(torch.equal(plain_g[k], streamed_g[k]) for k in plain_g if k != "alpha")
    x64, w64 = leaves["x"].double(), leaves["weight"].double()
    terms = (dy.double() * w64 * (1 - torch.tanh(leaves["alpha"].double() * x64) ** 2) * x64).abs().sum()
    assert (plain_g["alpha"].double() - streamed_g["alpha"].double()).abs() <= 1e-6 * terms
    assert not memory._zero_stages(launch.nchunks(37)).any()


@pytest.mark.skipif(not K.TABLES, reason="no tables here (no AVX-512, or slow gathers): 16-bit inputs compute tanh")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d, stream", [(1024, False), (300, False), (2048, True)])
def test_tables_give_the_bits_of_computing(gen, dtype, d, stream, monkeypatch):
    # A 16-bit input's tanh gathered from a table of all 65536 patterns (filled by the blocks'
    # own IR) must give the computed path's bits: every pattern (nan, inf, subnormals), then
    # finite values into saturation; rows in pairs (d = 1024, 2048), single with scalar heads
    # and tails (d = 300), and streamed (whose blocks start off the row's start).
    launch = importlib.import_module("normlab.kernels.cpu.launch")
    monkeypatch.setattr(launch, "STREAM_MIN_BYTES", 0 if stream else 1 << 62)
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
        dy = torch.randn(x.shape, generator=gen).to(dtype)
        runs = []
        for on in (False, True):
            use_tables(monkeypatch, on)
            sizes.clear()
            runs.append(_run(leaves, "cpu", dy))
            assert sizes == ([K.TABLE_SIZE, 2 * K.TABLE_SIZE] if on else [0, 0])  # the kernels were given the tables
        (y, g), (ty, tg) = runs
        assert torch.equal(y.view(torch.int16), ty.view(torch.int16))
        for k in g:
            assert g[k].view(torch.int32 if g[k].dtype == torch.float32 else torch.int16).equal(
                tg[k].view(torch.int32 if tg[k].dtype == torch.float32 else torch.int16)), k
    assert torch.isfinite(g["alpha"]) and torch.isfinite(g["weight"]).all()  # the finite input's sums are compared too


def test_tables_only_where_gathers_are_fast(tmp_path):
    # Linux's report of the Gather Data Sampling mitigation, which makes gathers slow: no tables
    status = tmp_path / "gather_data_sampling"
    for text, fast in (("Mitigation: Microcode\n", False), ("Not affected\n", True), ("Vulnerable\n", True)):
        status.write_text(text)
        assert K.gathers_are_fast(str(status)) is fast, text
    assert K.gathers_are_fast(str(tmp_path / "absent")) is True
