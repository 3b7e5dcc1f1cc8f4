"""Repository promises that are easy to break silently."""
import os
import re
import subprocess
import sys
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


def test_the_dockerfile_pins_what_pyproject_pins():
    import re
    import tomllib

    docker = (ROOT / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", docker, re.M))
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = {}
    for reqs in extras.values():
        for req in reqs:
            m = re.match(r"([\w.-]+)(?:\[[\w,]+\])?==([\w.]+)(?:; python_version >= '3.12')?$", req)
            if m:
                pins.setdefault(m.group(1), set()).add(m.group(2))
    for package, arg in (("vllm", "VLLM_VERSION"), ("megatron-core", "MEGATRON_CORE_VERSION"), ("triton", "TRITON_VERSION"),
                         ("flash-attn", "FLASH_ATTN_VERSION"), ("transformer-engine", "TRANSFORMER_ENGINE_VERSION")):
        assert args[arg] in pins[package], f"Dockerfile {arg}={args[arg]}, pyproject pins {package} {pins[package]}"
    assert 'pip install -e ".[vllm,megatron,triton,production]"' in docker
    torch = re.search(r"^FROM pytorch/pytorch:(\d+\.\d+)", docker, re.M).group(1)
    from lockstep.framework.rollout.vllm_plugin import TESTED_VLLM_VERSIONS

    assert args["VLLM_VERSION"] in TESTED_VLLM_VERSIONS and torch == "2.11"  # vLLM 0.26 is built for torch 2.11


def test_every_benchmark_script_imports_without_a_gpu():
    """The benchmarks run only on the GPU host, where a session's device time is scarce: a script that
    fails at import there (a renamed helper, a syntax error) costs a call. Each imports here, in a fresh
    interpreter with benchmarks/ on its path as when run as a script; none touches CUDA at import."""
    scripts = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py"))
    assert "bench_attention" in scripts and "sweep_attention" in scripts
    code = ("import importlib, sys, traceback\nfailed = []\nfor name in sys.argv[1:]:\n    try:\n"
            "        importlib.import_module(name)\n    except BaseException:\n"
            "        failed.append(name + ': ' + traceback.format_exc(limit=2).splitlines()[-1])\n"
            "print('\\n'.join(failed))\nsys.exit(1 if failed else 0)\n")
    res = subprocess.run([sys.executable, "-c", code, *scripts], cwd=ROOT / "benchmarks", capture_output=True,
                         text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT / "benchmarks")})
    assert res.returncode == 0, f"benchmark scripts that fail at import:\n{res.stdout}{res.stderr[-2000:]}"


def test_the_kernels_tests_collect_without_the_framework_extras():
    """benchmarks/gpu_session.sh's kernel_tests stage runs its default test files (read from the script)
    on the GPU host with only torch and triton (the call carries vLLM instead of Ray, Hydra and
    megatron-core), so conftest.py's imports and those files' must not need them. In a fresh
    interpreter where importing ray, hydra, omegaconf, megatron or vllm fails, pytest collects them;
    the control shows the block fires (the native rollout engine imports ray)."""
    block = ("import sys\nclass _Block:\n    def find_spec(self, name, path=None, target=None):\n"
             "        if name.split('.')[0] in ('ray', 'hydra', 'omegaconf', 'megatron', 'vllm'):\n"
             "            raise ImportError('blocked ' + name)\nsys.meta_path.insert(0, _Block())\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), "TRITON_INTERPRET": "1"}
    stage = (ROOT / "benchmarks" / "gpu_session.sh").read_text().split("    kernel_tests)", 1)[1].split(";;", 1)[0]
    files = re.search(r"\$\{GPU_TESTS:-([^}]*)\}", stage).group(1).split()  # the stage's default files
    assert "tests/test_attention.py" in files, files
    collect = block + ("import pytest\nsys.exit(pytest.main(['-q', '--collect-only', '-p', 'no:hydra_pytest', "
                       f"'-p', 'no:cacheprovider', *{files!r}]))\n")
    res = subprocess.run([sys.executable, "-c", collect], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0 and " collected" in res.stdout, res.stdout[-3000:] + res.stderr[-2000:]
    control = block + "import lockstep.framework.rollout.native\n"
    res = subprocess.run([sys.executable, "-c", control], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode != 0 and "blocked ray" in res.stderr, res.stderr[-2000:]
