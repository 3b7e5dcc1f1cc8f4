"""The math reward on tricky answers."""
import pytest

from lockstep.framework.data.rewards import extract_answer, get_reward_fn, last_boxed, math_reward


@pytest.mark.parametrize("response,label,reward", [
    ("The answer is \\boxed{\\frac{3}{4}}.", "3/4", 1.0),
    ("\\boxed{\\dfrac{1}{2}}", "0.5", 1.0),
    ("so it is 12.", "12", 1.0),
    ("\\boxed{1,000}", "1000", 1.0),
    ("x = \u22125", "-5", 1.0),  # unicode minus
    ("first 7, then finally 8", "7", 0.0),  # the last number counts
    ("\\boxed{7} but I meant 8", "7", 1.0),  # a boxed answer beats later numbers
    ("\\boxed{2^{10}}", "2^{10}", 1.0),  # nested braces
    ("\\boxed{ 42 }", "42", 1.0),
    ("$\\boxed{\\left(1,2\\right)}$", "(1,2)", 1.0),
    ("\\boxed{\\text{(B)}}", "(B)", 1.0),
    ("no digits at all", "3", 0.0),
    ("", "0", 0.0),
    ("3.50", "3.5", 1.0),
    ("0.333", "1/3", 0.0),  # exact comparison: rounding is not equality
    ("7+2=9", "9", 1.0),
    ("answer: 09", "9", 1.0),
])
def test_math_reward(response, label, reward):
    assert math_reward("", response, label) == reward


def test_extraction_helpers():
    assert last_boxed("\\boxed{a} \\boxed{b{c}}") == "b{c}"
    assert last_boxed("\\boxed{unclosed") is None
    assert extract_answer("\\boxed{unclosed 5") == "5"  # falls back to the last number


def test_unknown_reward_lists_valid():
    with pytest.raises(ValueError, match="valid: dapo, math"):
        get_reward_fn("f1")
