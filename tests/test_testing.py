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
