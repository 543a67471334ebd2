import time

import pytest
import torch

from lab import env
from lab.errors import InputError
from lab.timing import StageTimer, bench, ceilings, count_flops


def test_fingerprint_on_cpu():
    fp = env.fingerprint()
    assert fp["torch"].startswith("2.11")
    assert fp["python"] and fp["cpu"]
    if not torch.cuda.is_available():
        assert fp["gpu"] is None
        assert env.arch_tag() == "cpu"
        assert env.machine_label().startswith("CPU")
    names = {b["backend"]: b for b in env.backends()}
    assert {"cuda", "torch.compile", "cuda graphs", "fp8 matmul", "onnxruntime", "tensorrt"} <= set(names)
    for b in names.values():
        assert b["available"] or b["detail"], f"{b['backend']} unavailable without a reason"
    prov = env.provenance()
    assert prov["machine"] and prov["time_utc"]


def test_pick_device():
    assert env.pick_device("cpu").type == "cpu"
    if not torch.cuda.is_available():
        assert env.pick_device("auto").type == "cpu"
        with pytest.raises(InputError, match="no CUDA"):
            env.pick_device("cuda")


def test_stage_timer_nested_totals_and_shares():
    t = StageTimer("cpu")
    for _ in range(3):
        with t.stage("a"):
            time.sleep(0)
            with t.stage("inner"):
                sum(range(20000))
        with t.stage("b"):
            sum(range(10000))
    tot = t.totals()
    assert set(tot) == {"a", "a/inner", "b"}
    assert t.counts()["a"] == 3
    assert tot["a"] >= tot["a/inner"] > 0
    rows = {r["stage"]: r for r in t.report(n_frames=30)}
    assert abs(rows["a"]["share"] + rows["b"]["share"] - 1) < 1e-9
    assert rows["b"]["fps"] == pytest.approx(30 / tot["b"])
    assert "inner" in t.table(30)


def test_bench_median_and_flops():
    a = torch.randn(64, 64)
    calls = []
    r = bench(lambda x: calls.append(1) or x @ x, a, warmup=2, iters=5, flops=True, ceiling_tflops=1.0)
    assert len(calls) == 1 + 2 + 5  # flop-count pass + warm-up + timed
    assert r.iters == 5 and r.min_s <= r.median_s <= r.max_s
    assert r.flops == 2 * 64**3
    assert r.pct_of_ceiling == pytest.approx(100 * r.tflops / 1.0)
    assert count_flops(torch.nn.functional.linear, torch.randn(4, 8), torch.randn(16, 8)) == 2 * 4 * 8 * 16


def test_bench_rotates_inputs():
    seen = []
    xs = [(torch.tensor(float(i)),) for i in range(3)]
    bench(lambda x: seen.append(float(x)), inputs=xs, warmup=0, iters=6)
    assert seen == [0, 1, 2, 0, 1, 2]


def test_ceilings_cpu_quick():
    c = ceilings("cpu", quick=True)
    assert c["matmul_tflops"]["fp32"] > 0 and c["copy_gbps"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernels_only_times_the_kernels_without_the_hosts_launch_work():
    from lab.timing import gpu_ms

    x = torch.zeros(1024, device="cuda")

    def slow_host():   # 0.3 ms of host work before one tiny kernel, as a heavy Python call path has
        t = time.perf_counter()
        while time.perf_counter() - t < 3e-4:
            pass
        x.add_(1)

    assert gpu_ms(slow_host, iters=5) >= 0.25                       # the events saw the GPU wait for the host
    assert gpu_ms(slow_host, iters=5, kernels_only=True) < 0.1     # the GPU spun meanwhile: the kernel alone
