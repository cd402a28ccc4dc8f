"""The bound every backend is held to (normlab.testing.assert_close): what it accepts and what it
must refuse."""

import pytest
import torch

from normlab.testing import assert_close


def test_a_truth_too_large_for_the_dtype_accepts_the_inf_it_rounds_to():
    # float16's largest finite value is 65504; a true gradient of -8e6 is -inf in float16
    truth = torch.tensor([[-7.98e6, 1.5, 2.0], [3.0, 70000.0, -1.0]], dtype=torch.float64)
    ok = torch.tensor([[-float("inf"), 1.5, 2.0], [3.0, float("inf"), -1.0]], dtype=torch.float16)
    assert_close(ok, truth, lowp=ok, rule="row")
    assert_close(ok, truth)


@pytest.mark.parametrize("wrong", [float("inf"), 65504.0, 0.0])
def test_a_wrong_sign_or_a_finite_value_for_an_overflowing_truth_fails(wrong):
    truth = torch.tensor([-7.98e6, 1.5], dtype=torch.float64)
    with pytest.raises(AssertionError, match="inf pattern|out of bound"):
        assert_close(torch.tensor([wrong, 1.5], dtype=torch.float16), truth)


def test_an_inf_where_the_truth_is_in_range_fails():
    truth = torch.tensor([60000.0, 1.5], dtype=torch.float64)
    with pytest.raises(AssertionError, match="inf pattern"):
        assert_close(torch.tensor([float("inf"), 1.5], dtype=torch.float16), truth)
    # the same values in float32, where 7.98e6 is in range: inf is wrong there
    with pytest.raises(AssertionError, match="inf pattern"):
        assert_close(torch.tensor([-float("inf")], dtype=torch.float32),
                     torch.tensor([-7.98e6], dtype=torch.float64))


def test_nan_must_match_nan():
    truth = torch.tensor([float("nan"), 1.0], dtype=torch.float64)
    assert_close(torch.tensor([float("nan"), 1.0]), truth)
    with pytest.raises(AssertionError, match="nan pattern"):
        assert_close(torch.tensor([0.0, 1.0]), truth)
    with pytest.raises(AssertionError, match="nan pattern"):
        assert_close(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 1.0], dtype=torch.float64))


# A 16-bit value's unit in the last place at 1.25: bf16 keeps 7 bits after the point, fp16 10.
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


@pytest.mark.parametrize("dtype", list(ULP))
def test_one_unit_off_passes_and_two_fail_without_a_low_precision_reference(dtype):
    truth = torch.tensor([1.25], dtype=torch.float64)
    assert_close((truth + ULP[dtype]).to(dtype), truth)
    with pytest.raises(AssertionError, match="out of bound"):
        assert_close((truth + 2 * ULP[dtype]).to(dtype), truth)


@pytest.mark.parametrize("dtype", list(ULP))
def test_a_result_may_be_twice_as_wrong_as_the_low_precision_reference_and_no_more(dtype):
    truth = torch.tensor([1.25], dtype=torch.float64)
    lowp = (truth + 4 * ULP[dtype]).to(dtype)
    # the bound: 2 * 4 units + atol + rtol * 1.25 (about 1.25 units)
    assert_close((truth + 9 * ULP[dtype]).to(dtype), truth, lowp=lowp)
    with pytest.raises(AssertionError, match="out of bound"):
        assert_close((truth + 11 * ULP[dtype]).to(dtype), truth, lowp=lowp)


def test_float32_allows_long_sums_but_not_a_wrong_digit():
    truth = torch.tensor([1.0, -3.0], dtype=torch.float64)
    assert_close((truth * (1 + 1e-6)).float(), truth)
    with pytest.raises(AssertionError, match="out of bound"):
        assert_close((truth * (1 + 1e-5)).float(), truth)


def test_an_inf_of_the_wrong_sign_fails():
    truth = torch.tensor([float("inf"), 1.0], dtype=torch.float64)
    with pytest.raises(AssertionError, match="inf pattern"):
        assert_close(torch.tensor([-float("inf"), 1.0]), truth)


def test_the_row_rule_holds_each_row_to_its_own_low_precision_error():
    # row 0's low-precision reference is 8 units off, row 1's exact: an error of 4 units in row 1
    # is within the whole tensor's bound but not its row's
    u = ULP[torch.bfloat16]
    truth = torch.tensor([[1.25, 1.25], [1.25, 1.25]], dtype=torch.float64)
    lowp = (truth + torch.tensor([[8 * u, 0.0], [0.0, 0.0]], dtype=torch.float64)).bfloat16()
    actual = (truth + torch.tensor([[0.0, 0.0], [4 * u, 0.0]], dtype=torch.float64)).bfloat16()
    assert_close(actual, truth, lowp=lowp, rule="tensor")
    with pytest.raises(AssertionError, match="out of bound"):
        assert_close(actual, truth, lowp=lowp, rule="row")


def test_magnitude_widens_the_bound_only_where_it_exceeds_the_truth():
    # a difference of large terms: floating point bounds its error by the terms' size
    truth = torch.tensor([1e-3, 1e-3], dtype=torch.float64)
    actual = (truth + torch.tensor([0.0, 1e-4], dtype=torch.float64)).float()
    assert_close(actual, truth, magnitude=torch.tensor([1.0, 100.0], dtype=torch.float64))
    with pytest.raises(AssertionError, match="out of bound"):
        assert_close(actual, truth, magnitude=torch.tensor([100.0, 1.0], dtype=torch.float64))
    # a magnitude below |truth| leaves the bound |truth|'s
    big = torch.tensor([100.0, 100.0], dtype=torch.float64)
    assert_close((big + torch.tensor([0.0, 1e-4], dtype=torch.float64)).float(), big,
                 magnitude=torch.tensor([1e-3, 1e-3], dtype=torch.float64))
