"""SM partitions (CUDA green contexts): refused clearly without a GPU; on the GPU host (-m gpu) the two
streams' kernels run on their own SMs and give the same numbers."""
import pytest
import torch

from lab.accel.sm_partition import split_streams
from lab.errors import BackendUnavailable, InputError


def test_needs_a_cuda_device():
    with pytest.raises(BackendUnavailable, match="CUDA device"):
        split_streams(16, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_partition_restricts_the_small_stream_and_keeps_results():
    total = torch.cuda.get_device_properties(0).multi_processor_count
    for bad in (0, total, 8.0, True):
        with pytest.raises(InputError, match="small_sms"):
            split_streams(bad, "cuda")
    p = split_streams(8, "cuda")
    assert p.sms[0] >= 8 and sum(p.sms) <= total and split_streams(8, "cuda") is p
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.half)
    ref = a @ a

    def timed(stream):
        with torch.cuda.stream(stream):
            out = a @ a
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(5):
                a @ a
            e.record()
        e.synchronize()
        return out, s.elapsed_time(e)

    small, t_small = timed(p.small)
    large, t_large = timed(p.large)
    assert torch.equal(small, ref) and torch.equal(large, ref)
    assert t_small > 3 * t_large   # 8 SMs of ~132: the small stream is several times slower
