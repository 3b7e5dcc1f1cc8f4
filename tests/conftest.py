import os

import pytest
import torch

# Without a GPU, the Triton backend is tested through Triton's interpreter. The variable must be
# set before anything imports triton (vLLM does), hence here, at collection start.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers import fixed_order_interpreter_dot  # noqa: E402

fixed_order_interpreter_dot()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray cluster for every end-to-end test of the session (start-up costs ~10 s)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONHASHSEED": "0"}})
    yield
    ray.shutdown()
