"""Split-TF32 linear and attention on the GPU host (pytest -m gpu): the kernels at the motion model's shapes against
float64 (as close as cuBLAS's fp32 GEMM and SDPA's fp32 attention), and a full-size motion window with the switches,
compiled and captured in a CUDA graph, against the eager fp32 window."""
import pytest
import torch
import torch.nn.functional as F

from lab.techniques import tf32x3

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("k,n", [(530, 512), (512, 1024), (1024, 512), (512, 265)])
def test_kernel_is_as_close_to_float64_as_the_fp32_gemm(k, n):
    torch.manual_seed(0)
    x, w, b = torch.randn(160, k, device="cuda"), torch.randn(n, k, device="cuda") / k ** 0.5, torch.randn(n, device="cuda")
    ref = F.linear(x.double(), w.double(), b.double())
    assert tf32x3.applies(x, w)
    got = tf32x3.linear(x, w, b)
    assert _err(got, ref) < 2 * _err(F.linear(x, w, b), ref) + 1e-7
    one_pass = tf32x3.linear_triton(x, w, b, precision="tf32")
    assert _err(one_pass, ref) > 20 * _err(got, ref)   # the split is what keeps the fp32 digits


@pytest.mark.parametrize("lk", [80, 82])
def test_attention_kernel_at_the_motion_models_shapes(lk):
    # the self- (80 keys) and cross-attention (80 condition + 2 time tokens) of the motion model: B = 2, 8 heads of 64
    from lab.models.ditto import heads_attention

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 80, 512, device="cuda"), torch.randn(2, lk, 512, device="cuda"), torch.randn(2, lk, 512, device="cuda")
    sp = lambda t: t.double().unflatten(-1, (8, -1)).transpose(1, 2)  # noqa: E731
    ref = F.scaled_dot_product_attention(sp(q), sp(k), sp(v)).transpose(1, 2).flatten(-2)
    got = tf32x3.attention(q, k, v, 8)
    assert _err(got, ref) < 2 * _err(heads_attention(q, k, v, 8), ref) + 1e-6


def test_motion_window_with_split_tf32_matches_the_eager_fp32_window(monkeypatch):
    from lab.models import ditto as D
    from lab.pipelines import ditto as P

    engine = P.build(P.Config(size="full", techniques=("batch_cfg",)), "cuda")
    g = torch.Generator().manual_seed(0)
    L, S = engine.dims.seq_frames, engine.cfg.sampling_steps
    cond = torch.randn(L, engine.dims.cond_dim, generator=g).cuda()
    noises = torch.randn(S, 1, L, D.MOTION_DIM, generator=g).cuda()
    x = torch.randn(1, L, D.MOTION_DIM, generator=g).cuda()
    cf = torch.randn(D.MOTION_DIM, generator=g).cuda()
    sched = D.Schedule.make(S)
    ref = P.sample_window(engine, cf, cond, sched, noises, None, x=x)
    ran = {"linear": 0, "attention": 0}
    for name in ran:   # the custom ops call these at run time (warm-up and capture): the kernels really ran
        real = getattr(tf32x3, f"{name}_triton")
        monkeypatch.setattr(tf32x3, f"{name}_triton",
                            lambda *a, _real=real, _name=name, **k: ran.__setitem__(_name, ran[_name] + 1) or _real(*a, **k))
    for extra in ((), ("motion_triton_attention",)):
        fast = P.reconfigure(engine, runtime="graph", techniques=("batch_cfg", "motion_compile", "motion_tf32x3", *extra))
        a = P.sample_window(fast, cf, cond, sched, noises, None, x=x)
        assert ran["linear"] > 0 and (ran["attention"] > 0) == bool(extra)
        b = P.sample_window(fast, cf, cond, sched, noises, None, x=x)   # a graph replay
        assert torch.equal(a, b)
        # measured on an H200 with the GEMMs alone: 9.5e-6 (the compiled fp32 window: 8.1e-6) on outputs up to ~5
        assert (a - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())


def test_motion_window_with_pdl_is_the_same_window(monkeypatch):
    from lab.models import ditto as D
    from lab.pipelines import ditto as P

    engine = P.build(P.Config(size="full", runtime="graph", techniques=("batch_cfg", "motion_compile", "motion_tf32x3",
                                                                         "motion_triton_attention")), "cuda")
    g = torch.Generator().manual_seed(0)
    L, S = engine.dims.seq_frames, engine.cfg.sampling_steps
    args = (torch.randn(D.MOTION_DIM, generator=g).cuda(), torch.randn(L, engine.dims.cond_dim, generator=g).cuda(),
            D.Schedule.make(S), torch.randn(S, 1, L, D.MOTION_DIM, generator=g).cuda(), None)
    x = torch.randn(1, L, D.MOTION_DIM, generator=g).cuda()
    ref = P.sample_window(engine, *args, x=x).clone()
    from lab.runtime import pdl as pdl_mod

    seen = []
    real = tf32x3.linear_triton
    monkeypatch.setattr(tf32x3, "linear_triton", lambda *a, **k: seen.append(pdl_mod.enabled()) or real(*a, **k))
    pdl = P.reconfigure(engine, techniques=engine.cfg.techniques + ("motion_pdl",))
    a = P.sample_window(pdl, *args, x=x).clone()
    assert seen and all(seen) and not pdl_mod.enabled()   # on while the window's kernels launched, off after
    assert torch.equal(a, P.sample_window(pdl, *args, x=x))   # a replay of the graph captured with PDL
    assert (a - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())
