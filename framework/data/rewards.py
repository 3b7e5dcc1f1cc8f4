"""Rule-based rewards (data.reward), each `(prompt, response, label) -> float`.

`math`: 1.0 when the response's final answer equals the label. The final answer is the content of
the last \\boxed{...} (nested braces allowed) or, without one, the last number in the response.
Both sides are normalised (spaces, $, \\left/\\right, \\dfrac, thousands separators, unicode
minus, trailing period) and compared as exact fractions when both parse as numbers, else as
strings. (The synthetic digit task answers with bare digits, hence the last-number fallback.)

`dapo`: the grading of DAPO's math reward for dapo-math-17k: only the last \\boxed{...} counts (no
box: 0.0); it and the label are normalised the way DAPO's grader does (Minerva's
`normalize_final_answer`: the part after the last "=", units and filler words removed, \\text /
\\textbf / \\overline / \\boxed unwrapped, "\\frac12" -> "\\frac{1}{2}", "\\sqrt3" ->
"\\sqrt{3}", $ dropped, thousands separators of integers dropped) and compared as strings.
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


# DAPO's grader (Minerva's answer normalisation): substitutions, then expressions removed
_DAPO_SUBSTITUTIONS = [("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
                       (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}")]
_DAPO_REMOVED = ["square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
                 "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
                 "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
                 "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}",
                 "\\;", ",\\!", "{,}", '"', "\\dots"]


def dapo_normalize(answer: str) -> str:
    answer = answer.split("=")[-1]
    for before, after in _DAPO_SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for expr in _DAPO_REMOVED:
        answer = answer.replace(expr, "")
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", answer)
    for wrapper in ("text", "textbf", "overline", "boxed"):
        answer = re.sub(r"(\\" + wrapper + r"\{)(.*?)(\})" if wrapper != "boxed" else r"(\\boxed\{)(.*)(\})",
                        "\\2", answer)
    answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", answer)
    answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def dapo_reward(prompt: str, response: str, label: str) -> float:
    boxed = last_boxed(response)
    return 1.0 if boxed is not None and dapo_normalize(boxed) == dapo_normalize(str(label)) else 0.0


REWARDS: dict[str, Callable[[str, str, str], float]] = {"math": math_reward, "dapo": dapo_reward}


def get_reward_fn(name: str) -> Callable[[str, str, str], float]:
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}; valid: {', '.join(sorted(REWARDS))}")
    return REWARDS[name]
