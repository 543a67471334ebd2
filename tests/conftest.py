import numpy as np
import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models on a shared 2-core CI box: a second intra-op thread only adds sync cost, and
    OpenMP threads spinning against other jobs make each op ~10-30× slower under load. Modules opt
    in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture
def triton_interpreter():
    """Run a Python snippet under Triton's CPU interpreter and return its stdout. A subprocess: the
    interpreter is chosen when a kernel is defined, i.e. at import."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def run(code: str) -> str:
        r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TRITON_INTERPRET="1"),
                           capture_output=True, text=True, timeout=120, cwd=root)
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout
    return run


class Collect:
    """A writer that keeps copies of what it is given (the pipelines may reuse their buffers)."""

    def __init__(self):
        self.frames = []

    def write(self, f):
        self.frames.append(np.array(f))

    def close(self):
        pass

    def abort(self):
        pass


@pytest.fixture
def collector():
    """The `Collect` writer class: a test makes one per run."""
    return Collect
