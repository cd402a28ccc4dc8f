"""normlab.reference against independent float64 formulas written here, on fresh random inputs."""

import math

import pytest
import torch

from normlab import reference as R
from normlab.testing import assert_close

SIZES = [1, 3, 123, 3000]
LEADS = [(0,), (1,), (7,), (2, 5)]
DTYPES = [torch.float32, torch.float64]


def rand(gen, *shape, dtype=torch.float64, scale=1.0, mean=0.0):
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale + mean).to(dtype)


# Independent formulas: torch.var_mean and vector norms in float64, not the reference's code path.
def ln_truth(x, w=None, b=None, eps=1e-5):
    x = x.double()
    var, mu = torch.var_mean(x, dim=-1, keepdim=True, unbiased=False)
    y = (x - mu) / torch.sqrt(var + eps)
    if w is not None:
        y = y * w.double()
    if b is not None:
        y = y + b.double()
    return y


def rms_truth(x, w=None, eps=1e-6, eps_mode="inside", offset=0.0, partial=None):
    x = x.double()
    d = x.shape[-1]
    k = d if partial is None else max(1, math.ceil(round(partial * d, 9)))
    rms = torch.linalg.vector_norm(x[..., :k], dim=-1, keepdim=True) / math.sqrt(k)
    y = x / (torch.sqrt(rms**2 + eps) if eps_mode == "inside" else rms + eps)
    if w is not None:
        y = y * (w.double() + offset)
    return y


@pytest.mark.filterwarnings("ignore:var_mean")  # the truth's var_mean on zero rows
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead", LEADS)
@pytest.mark.parametrize("d", SIZES)
@pytest.mark.parametrize("affine", ["none", "weight", "weight+bias"])
def test_layer_norm(gen, dtype, lead, d, affine):
    x = rand(gen, *lead, d, dtype=dtype, scale=3.0, mean=0.5)
    w = rand(gen, d, dtype=dtype) if affine != "none" else None
    b = rand(gen, d, dtype=dtype) if affine == "weight+bias" else None
    y = R.layer_norm(x, w, b, 1e-5)
    assert y.dtype == dtype
    # x - mean cancels when a row's values are close (d = 3): the error scales with |x| * rstd
    xd = x.double()
    rstd = torch.rsqrt((xd - xd.mean(-1, keepdim=True)).pow(2).mean(-1, keepdim=True) + 1e-5)
    mag = (xd.abs() + xd.mean(-1, keepdim=True).abs()) * rstd * (w.double().abs() if w is not None else 1.0)
    assert_close(y, ln_truth(x, w, b, 1e-5), magnitude=mag)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead", LEADS)
@pytest.mark.parametrize("d", SIZES)
@pytest.mark.parametrize(
    "opts",
    [
        {},
        {"eps_mode": "outside"},
        {"cast": "gemma", "offset": 1.0},
        {"partial": 0.0625},
        {"partial": 0.5, "eps_mode": "outside", "cast": "gemma"},
        {"weightless": True},
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default",
)
def test_rms_norm(gen, dtype, lead, d, opts):
    opts = dict(opts)
    weightless = opts.pop("weightless", False)
    x = rand(gen, *lead, d, dtype=dtype, scale=2.0)
    w = None if weightless else rand(gen, d, dtype=dtype)
    y = R.rms_norm(x, w, 1e-6, **opts)
    assert y.dtype == dtype
    truth = rms_truth(x, w, 1e-6, opts.get("eps_mode", "inside"), opts.get("offset", 0.0),
                      opts.get("partial"))
    assert_close(y, truth)


def test_partial_size_rounds_up_and_is_exact_for_integers():
    assert R.partial_size(1024, 0.0625) == 64
    assert R.partial_size(100, 0.07) == 7  # 0.07 * 100 = 7.000000000000001 in floats
    assert R.partial_size(10, 0.01) == 1
    assert R.partial_size(10, 0.15) == 2
    assert R.partial_size(10, 1.0) == 10
    assert R.partial_size(10, None) == 10


def test_partial_rms_uses_only_leading_features(gen):
    x = rand(gen, 4, 64)
    y = R.rms_norm(x, partial=0.25)
    x2 = x.clone()
    x2[:, 16:] *= 100.0  # features beyond k do not enter the statistic, only get scaled
    y2 = R.rms_norm(x2, partial=0.25)
    assert torch.allclose(y2[:, :16], y[:, :16], rtol=1e-12, atol=0)
    assert torch.allclose(y2[:, 16:], 100 * y[:, 16:], rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cast_orders_differ_and_each_matches_its_hand_written_order(gen, dtype):
    x = rand(gen, 64, 256, dtype=dtype, scale=3.0)
    w = (1 + 0.3 * rand(gen, 256)).to(dtype)
    eps = 1e-6

    # Llama: normalize in fp32, cast to the input dtype, multiply by the weight in that dtype.
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    llama = w * normed.to(dtype)
    # Gemma / OLMo 2: multiply by (offset + w) in fp32 and cast last.
    gemma = (normed * (0.0 + w.float())).to(dtype)
    gemma1 = (normed * (1.0 + w.float())).to(dtype)

    got_llama = R.rms_norm(x, w, eps, cast="llama")
    got_gemma = R.rms_norm(x, w, eps, cast="gemma")
    got_gemma1 = R.rms_norm(x, w, eps, cast="gemma", offset=1.0)
    assert torch.equal(got_llama, llama)
    assert torch.equal(got_gemma, gemma)
    assert torch.equal(got_gemma1, gemma1)
    assert not torch.equal(got_llama, got_gemma), "the two cast orders should round differently somewhere"
    # Both stay within the dtype's bound of the float64 truth.
    truth = rms_truth(x, w, eps)
    assert_close(got_llama, truth)
    assert_close(got_gemma, truth)


def test_torch_rms_norm_is_the_gemma_order(gen):
    x = rand(gen, 32, 128, dtype=torch.bfloat16, scale=2.0)
    w = rand(gen, 128, dtype=torch.bfloat16)
    assert torch.equal(torch.nn.functional.rms_norm(x, (128,), w, 1e-6), R.rms_norm(x, w, 1e-6, cast="gemma"))


def test_layer_norm_large_mean_rows_do_not_cancel(gen):
    d = 4096
    x = rand(gen, 16, d, dtype=torch.float32, mean=1e4)  # unit spread around 1e4
    truth = ln_truth(x)
    y = R.layer_norm(x)
    err = (y.double() - truth).abs().max().item()
    assert err < 5e-3, err
    # The one-pass formula the reference must not use fails here: that is what the test guards.
    xf = x.float()
    mu = xf.mean(-1, keepdim=True)
    var_one_pass = (xf * xf).mean(-1, keepdim=True) - mu * mu
    one_pass = (xf - mu) * torch.rsqrt(var_one_pass.clamp_min(0) + 1e-5)
    assert (one_pass.double() - truth).abs().max().item() > 50 * err


# the residual sum's dtype: the inputs', or with residual_in_fp32 at least float32 (float64 stays)
SUM_DTYPES = {(torch.float32, False): torch.float32, (torch.float32, True): torch.float32,
              (torch.bfloat16, False): torch.bfloat16, (torch.bfloat16, True): torch.float32,
              (torch.float64, False): torch.float64, (torch.float64, True): torch.float64}


@pytest.mark.parametrize("residual_in_fp32", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_add_norms_return_the_norm_of_the_sum_and_the_sum(gen, dtype, residual_in_fp32):
    x = rand(gen, 3, 5, 96, dtype=dtype)
    r = rand(gen, 3, 5, 96, dtype=dtype)
    w = rand(gen, 96, dtype=dtype)
    b = rand(gen, 96, dtype=dtype)
    y, s = R.add_rms_norm(x, r, w, 1e-6, residual_in_fp32=residual_in_fp32)
    ly, ls = R.add_layer_norm(x, r, w, b, 1e-5, residual_in_fp32=residual_in_fp32)
    sum_dtype = SUM_DTYPES[dtype, residual_in_fp32]
    assert s.dtype == ls.dtype == sum_dtype
    assert y.dtype == ly.dtype == dtype
    expected_sum = x.to(sum_dtype) + r.to(sum_dtype)
    assert torch.equal(s, expected_sum) and torch.equal(ls, expected_sum)
    assert_close(y, rms_truth(expected_sum, w, 1e-6), dtype=dtype)
    assert_close(ly, ln_truth(expected_sum, w, b, 1e-5), dtype=dtype)


def half_ulp(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half the spacing of ``dtype``'s values at float64 ``v``: the most one rounding to it moves v."""
    info = torch.finfo(dtype)
    mantissa_bits = {torch.bfloat16: 7, torch.float16: 10}[dtype]
    _, e = torch.frexp(v)  # |v| = m * 2^e, m in [0.5, 1)
    e = torch.clamp(e, min=math.frexp(info.smallest_normal)[1])  # subnormals share the smallest spacing
    return torch.ldexp(torch.full_like(v, 0.5), e - 1 - mantissa_bits)


@pytest.mark.parametrize("fn", ["dyt", "derf"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_pointwise_norms_in_16_bit_round_once(gen, fn, dtype):
    # Computed in float32 and cast last: within half a unit of the dtype (plus float32's own error)
    # of the exact result. The same math in the 16-bit dtype rounds at every step, up to 2 units
    # off. The kernels' tests bound their error by this result's, so it must be this good.
    x = rand(gen, 64, 300, dtype=dtype, scale=2.0)
    w, b = rand(gen, 300, dtype=dtype), rand(gen, 300, dtype=dtype)
    alpha = torch.tensor([0.7], dtype=dtype)
    if fn == "dyt":
        y = R.dyt(x, alpha, w, b)
        truth = torch.tanh(alpha.double() * x.double()) * w.double() + b.double()
    else:
        shift = torch.tensor([0.3], dtype=dtype)
        y = R.derf(x, alpha, shift, w, b)
        truth = torch.erf(alpha.double() * x.double() + shift.double()) * w.double() + b.double()
    assert y.dtype == dtype
    # float32's error: a few of its units of the terms (|w| and |b| bound them)
    slack = 4 * torch.finfo(torch.float32).eps * (w.double().abs() + b.double().abs())
    err = (y.double() - truth).abs()
    assert torch.all(err <= half_ulp(truth, dtype) + slack), err.max()


def test_upcast_false_computes_in_the_input_dtype(gen):
    # fp16 sums of squares overflow at |x| ~ 256 * sqrt(65504 / (256^2 d))...: with x = 300 every
    # square is 90000 > 65504, so the naive fp16 RMSNorm returns zeros, the upcast one does not.
    x = torch.full((2, 64), 300.0, dtype=torch.float16)
    naive = R.rms_norm(x, upcast=False)
    good = R.rms_norm(x)
    assert torch.all(naive == 0)
    assert_close(good, rms_truth(x))


# --------------------------------------------------------------------------- sequence BatchNorm


def sbn_truth(x, mask, eps=1e-5):
    rows = x.double()[mask]
    var, mu = torch.var_mean(rows, dim=0, unbiased=False)
    return (x.double() - mu) / torch.sqrt(var + eps), mu, torch.var(rows, dim=0, unbiased=True)


def test_seq_batch_norm_uses_only_real_positions(gen):
    B, T, d = 4, 9, 17
    x = rand(gen, B, T, d, scale=2.0, mean=1.0)
    lengths = torch.tensor([9, 3, 6, 1])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    rm, rv = torch.zeros(d, dtype=torch.float64), torch.ones(d, dtype=torch.float64)
    y = R.seq_batch_norm(x, mask, rm, rv, training=True, momentum=0.1)
    truth, mu, unbiased = sbn_truth(x, mask)
    assert_close(y[mask], truth[mask])
    # Running stats follow the EMA with momentum 0.1 and the unbiased variance.
    assert_close(rm, 0.9 * 0 + 0.1 * mu)
    assert_close(rv, 0.9 * 1 + 0.1 * unbiased)
    # Changing the padding changes nothing at the real positions, nor the running stats.
    x2 = x.clone()
    x2[~mask] = rand(gen, int((~mask).sum()), d) * 1e3
    rm2, rv2 = torch.zeros_like(rm), torch.ones_like(rv)
    y2 = R.seq_batch_norm(x2, mask, rm2, rv2, training=True)
    assert torch.equal(y2[mask], y[mask])
    assert torch.equal(rm2, rm) and torch.equal(rv2, rv)


def test_seq_batch_norm_keeps_the_running_variance_for_one_real_token(gen):
    # one token has no unbiased variance (torch's BatchNorm refuses it); a variance of 0 in its
    # place would pull the running variance down and inflate eval outputs
    x = rand(gen, 2, 3, 5, scale=2.0, mean=1.0)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    mask[1, 2] = True
    rm, rv = torch.zeros(5, dtype=torch.float64), torch.full((5,), 2.0, dtype=torch.float64)
    y = R.seq_batch_norm(x, mask, rm, rv, training=True, momentum=0.1)
    assert torch.equal(rv, torch.full((5,), 2.0, dtype=torch.float64))
    assert_close(rm, 0.1 * x[1, 2].double())
    assert_close(y[mask], torch.zeros(1, 5, dtype=torch.float64))  # the token minus its own mean


def test_seq_batch_norm_eval_uses_running_stats(gen):
    d = 8
    x = rand(gen, 2, 5, d)
    rm, rv = rand(gen, d), rand(gen, d).abs() + 0.5
    w, b = rand(gen, d), rand(gen, d)
    y = R.seq_batch_norm(x, None, rm, rv, w, b, training=False, eps=1e-5)
    assert_close(y, (x - rm) / torch.sqrt(rv + 1e-5) * w + b)


@pytest.mark.parametrize("training", [True, False])
def test_seq_batch_norm_matches_batchnorm1d_when_mask_is_all_true(gen, training):
    B, T, d = 3, 7, 12
    x = rand(gen, B, T, d, dtype=torch.float32)
    bn = torch.nn.BatchNorm1d(d, momentum=0.1, eps=1e-5)
    with torch.no_grad():
        bn.weight.copy_(rand(gen, d)), bn.bias.copy_(rand(gen, d))
        bn.running_mean.copy_(rand(gen, d)), bn.running_var.copy_(rand(gen, d).abs() + 0.5)
    rm, rv = bn.running_mean.clone(), bn.running_var.clone()
    bn.train(training)
    expected = bn(x.transpose(1, 2)).transpose(1, 2)  # BatchNorm1d wants (B, C, T)
    mask = torch.ones(B, T, dtype=torch.bool)
    y = R.seq_batch_norm(x, mask, rm, rv, bn.weight, bn.bias, training=training)
    assert torch.allclose(y, expected, atol=1e-5, rtol=1e-5)
    assert torch.allclose(rm, bn.running_mean, atol=1e-6) and torch.allclose(rv, bn.running_var, atol=1e-6)


def test_eps_outside_gives_a_finite_gradient_on_all_zero_rows(gen):
    # autograd of sqrt at 0 multiplies an infinite derivative by 0 (nan); the derivative of
    # x / (rms + eps) on an all-zero row (padding) is 1 / eps, as the fused kernels compute it
    x = torch.zeros(3, 16, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 16, generator=gen, dtype=torch.float64)
    R.rms_norm(x, None, 1e-6, eps_mode="outside").backward(g)
    assert torch.allclose(x.grad, g / 1e-6, rtol=1e-12)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_eps_outside_keeps_a_non_finite_row_statistic(gen, bad):
    # The zero-row guard above must not catch a nan mean square (nan > 0 is false, and it once
    # made the row's rms 0): one nan in a row makes its whole output nan, as x / (rms + eps)
    # does written out; one inf makes rms inf and every other output 0.
    x = torch.randn(2, 16, generator=gen, dtype=torch.float64)
    x[1, 3] = bad
    y = R.rms_norm(x, None, 1e-6, eps_mode="outside")
    want = x / (x.square().mean(-1, keepdim=True).sqrt() + 1e-6)
    assert torch.equal(torch.isnan(y),
                       torch.isnan(want)) and torch.isnan(y[1]).sum() == (16 if bad != bad else 1)
    assert_close(y[0], want[0])
