import functools
import os

# Each xdist worker gets its share of the cores for torch's intra-op threads (and the processes a
# test starts inherit it): two workers of two threads each on two cores spin against each other.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

import pytest  # noqa: E402
import torch  # noqa: E402

from tensorstow.executor import cuda
from tensorstow.ir.models import GPT, PRESETS
from tensorstow.ir.trace import trace

# The suite compares the executor with eager PyTorch on the CPU, bit for bit: its device tier is
# budgeted host memory even where CUDA exists. tests/test_executor_cuda.py asks for CUDA itself.
cuda.default_device = "cpu"


@functools.lru_cache(maxsize=None)
def traced_tiny(precision="fp32", batch=2, seq=32):
    torch.manual_seed(0)
    model = GPT(PRESETS["gpt-tiny"])
    return model, trace(model, batch=batch, seq=seq, precision=precision, model_name="gpt-tiny")


@pytest.fixture
def tiny():
    return traced_tiny()
