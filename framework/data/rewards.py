"""Rule-based rewards. `math_reward`: 1.0 when the response's final answer equals the label.

The final answer is the content of the last \\boxed{...} (nested braces allowed) or, without one,
the last number in the response. Both sides are normalised (spaces, $, \\left/\\right, \\dfrac,
thousands separators, unicode minus, trailing period) and compared as exact fractions when both
parse as numbers, else as strings.
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Callable

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")


def last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None  # unbalanced braces: not a boxed answer (the last number is used instead)


def extract_answer(text: str) -> str | None:
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(_normalise(text, keep_spaces=True))
    return numbers[-1] if numbers else None


def _normalise(s: str, keep_spaces: bool = False) -> str:
    s = s.replace("\u2212", "-").replace("\\left", "").replace("\\right", "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\!", "")
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    s = s.replace("$", "")
    if not keep_spaces:
        s = re.sub(r"\s+", "", s)
    s = re.sub(r"\\frac\{(-?\d+)\}\{(-?\d+)\}", r"\1/\2", s)
    s = re.sub(r"^(-?)\\frac(\d)(\d)$", r"\1\2/\3", s)  # \frac34
    return s.rstrip(".")


def _as_number(s: str) -> Fraction | None:
    s = s.strip()
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def answers_equal(answer: str, label: str) -> bool:
    a, b = _normalise(answer), _normalise(label)
    na, nb = _as_number(a), _as_number(b)
    if na is not None and nb is not None:
        return na == nb
    return a == b


def math_reward(prompt: str, response: str, label: str) -> float:
    answer = extract_answer(response)
    return 1.0 if answer is not None and answers_equal(answer, str(label)) else 0.0


REWARDS: dict[str, Callable[[str, str, str], float]] = {"math": math_reward}


def get_reward_fn(name: str) -> Callable[[str, str, str], float]:
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}; valid: {', '.join(sorted(REWARDS))}")
    return REWARDS[name]
