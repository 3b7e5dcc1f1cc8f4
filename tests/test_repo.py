"""Repository promises that are easy to break silently."""
import re
from pathlib import Path

from lockstep.framework.data.synthetic import TASKS, render, task_path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    blocks = re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)
    test_cmd = next(b for b in blocks if "pytest" in b and "venv" in b)
    assert test_cmd in (ROOT / ".ci" / "run").read_text()


def test_shipped_synthetic_tasks_match_their_generator():
    for name in TASKS:
        assert task_path(name).read_text() == render(name), "regenerate with python -m lockstep.framework.data.synthetic"
