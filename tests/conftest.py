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
