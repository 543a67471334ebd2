"""LatentSync on the GPU host (pytest -m gpu): the fast runners compute what eager computes, and the
pipeline's graph runner falls back to eager for a short last block."""
import pytest
import torch

from lab.pipelines.latentsync import sampling as sampling
from lab.metrics import cosine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def tiny():
    from lab.models.latentsync import load_latentsync_unet

    m = load_latentsync_unet("random", "tiny", device="cuda", dtype=torch.float16).model
    return m, sampling.example_inputs(m, 2, 16, (16, 16), "cuda", torch.float16)


@pytest.mark.parametrize("how", ["cudagraph", "compile", "compile+cudagraph"])
def test_fast_runner_matches_eager(tiny, how):
    m, ex = tiny
    with torch.inference_mode():
        ref = m(*ex).float()
    r = sampling.fast_unet(m, how, ex)
    other = tuple(torch.randn_like(x) if x.is_floating_point() else x for x in ex)
    with torch.inference_mode():
        ref2 = m(*other).float()
    assert cosine(r(*ex).float(), ref) > 0.9999
    assert cosine(r(*other).float(), ref2) > 0.9999  # staging buffers refilled on every call


def test_pipeline_graph_runner_equals_eager_including_short_block():
    import numpy as np

    from lab import data
    from lab.pipelines import latentsync as P
    from lab.avatar import avatar_loop

    frames = avatar_loop(4, (128, 192))
    a, sr = data.default_audio()
    eng = P.build(P.Config(size="tiny", mode="ddim4", block=8), "cuda")
    job = P.make_job(eng, P.prepare(eng, frames), a[:int(sr * 0.8)], sr)  # 20 frames: blocks of 8, 8, 4
    eager = P.run(eng, None, job=job, keep_faces=True)
    eng = P.reconfigure(eng, runtime="graph")
    fast = P.run(eng, None, job=job, keep_faces=True)
    assert fast.n_frames == eager.n_frames == 20
    assert cosine(fast.latents, eager.latents) > 0.9999
    assert np.isfinite(fast.latents.numpy()).all()


@pytest.mark.parametrize("runtime", ["graph", "compile+graph"])
def test_pipeline_vae_runners_match_eager(runtime):
    import numpy as np

    from lab import data
    from lab.pipelines import latentsync as P
    from lab.avatar import avatar_loop

    frames = avatar_loop(4, (128, 192))
    a, sr = data.default_audio()
    eng = P.build(P.Config(size="tiny", mode="ddim2", block=8), "cuda")
    job = P.make_job(eng, P.prepare(eng, frames), a[:int(sr * 0.8)], sr)  # 20 frames: blocks of 8, 8, 4
    eager = P.run(eng, None, job=job, keep_faces=True)
    # the runtime builds the UNet's runner too: the VAE's runners are judged against the same UNet runner with
    # the VAE eager (the derived engines share that runner), the whole against eager by the latents' cosine
    runner = P.reconfigure(eng, runtime=runtime)
    unet_only = P.run(runner, None, job=job, keep_faces=True)
    eng = P.reconfigure(runner, techniques=("vae_runtime",))
    assert eng.runner is runner.runner
    calls = []
    enc = eng.vae_encode
    eng.vae_encode = lambda x: calls.append(tuple(x.shape)) or enc(x)
    fast = P.run(eng, None, job=job, keep_faces=True)
    assert calls == [(16, 3, 64, 64)] * 3                # both encodes of a block in one replay, the short one padded
    assert cosine(fast.latents, eager.latents) > 0.9999
    assert np.abs(fast.faces.int() - unet_only.faces.int()).max() <= 2


def test_compiled_graph_with_guided_shortcuts_matches_eager(tiny):
    from lab.models.latentsync import fuse_qkv

    m, _ = tiny
    ex = sampling.guided_example(m, 16, (16, 16), "cuda", torch.float16)
    with torch.inference_mode():
        ref = m(*ex).float()
    fuse_qkv(m)
    try:
        r = sampling.fast_unet(sampling.GuidedShortcuts(m), "compile+cudagraph", ex)
        assert cosine(r(*ex).float(), ref) > 0.9999
    finally:
        fuse_qkv(m, False)


@pytest.mark.parametrize("how", ["cudagraph", "compile+cudagraph"])
def test_feature_cache_runners_match_the_eager_cache(tiny, how):
    from lab.models.latentsync import fuse_qkv

    m, _ = tiny
    ex = sampling.guided_example(m, 16, (16, 16), "cuda", torch.float16)
    lat = sampling.initial_noise((1, 4, 16, 16), 16, seed=0, device="cuda", dtype=torch.float16)
    cond, audio = ex[0][1:, 4:], ex[2][16:]
    with torch.inference_mode():
        ref = sampling.denoise(sampling.feature_cache(m, 3), lat, cond, audio, "deepcache3").float()
    fuse_qkv(m)
    try:
        full, shallow = sampling.fast_feature_cache(m, how, ex)
        cache = sampling.FeatureCache(3, full, shallow)
        with torch.inference_mode():
            out = sampling.denoise(cache, lat, cond, audio, "deepcache3").float()
            again = sampling.denoise(cache, lat, cond, audio, "deepcache3").float()   # next block: reset, same result
    finally:
        fuse_qkv(m, False)
    assert cache.full_calls == 14
    assert cosine(out, ref) > 0.9999 and torch.equal(out, again)


def test_pipeline_builds_the_feature_cache_runners_through_reconfigure():
    import numpy as np

    from lab import data
    from lab.pipelines import latentsync as P
    from lab.avatar import avatar_loop

    frames = avatar_loop(4, (128, 192))
    a, sr = data.default_audio()
    eng = P.build(P.Config(size="tiny", mode="deepcache3", block=8), "cuda")
    job = P.make_job(eng, P.prepare(eng, frames), a[:int(sr * 0.8)], sr)  # 20 frames: blocks of 8, 8, 4 (the last eager)
    eager = P.run(eng, None, job=job, keep_faces=True)
    eng = P.reconfigure(eng, runtime="graph")
    assert eng.runner is None and eng.cache_runners is not None
    fast = P.run(eng, None, job=job, keep_faces=True)
    assert fast.n_frames == eager.n_frames == 20
    assert cosine(fast.latents, eager.latents) > 0.9999
    assert np.isfinite(fast.latents.numpy()).all()


def test_triton_temporal_attention_matches_sdpa_compiled_in_one_graph():
    from lab.techniques import short_attention as sa
    from lab.models.latentsync import attention

    q, k, v = torch.randn(512, 16, 3 * 320, device="cuda", dtype=torch.float16).chunk(3, -1)  # fused projection
    ref = attention(q, k, v, 8).float()
    assert cosine(sa.short_attention(q, k, v, 8).float(), ref) > 0.99999
    sa.register()
    fn = torch.compile(lambda q, k, v: attention(q, k, v, 8, "triton"), fullgraph=True)
    assert cosine(fn(q, k, v).float(), ref) > 0.99999


def test_compiled_graph_with_pdl_matches_eager(tiny, monkeypatch):
    from lab.techniques import block_norm
    from lab.runtime import pdl
    from lab.techniques import short_attention as sa

    if not pdl.supported():
        pytest.skip("programmatic dependent launch needs compute capability 9.0 or later")
    m, ex = tiny
    with torch.inference_mode():
        ref = m(*ex).float()
    block_norm.fuse_block_norms(m)
    seen = []
    real = block_norm.block_group_norm_triton
    monkeypatch.setattr(block_norm, "block_group_norm_triton", lambda *a, **k: seen.append(pdl.enabled()) or real(*a, **k))
    try:
        m.to(memory_format=torch.channels_last)
        r = sampling.fast_unet(m, "compile+cudagraph", ex, pdl=True)
        assert cosine(r(*ex).float(), ref) > 0.9999
        assert seen and all(seen) and not pdl.enabled()   # the passes were captured with PDL on, and it is off after
        assert sa.launch_options() == {"USE_PDL": False}
    finally:
        block_norm.unfuse_block_norms(m)
        m.to(memory_format=torch.contiguous_format)


def test_exact_preset_computes_the_upstream_preset():
    """The exact preset on the GPU (compile + CUDA graph, every exact technique, the temporal attention on its Triton
    kernel) against the upstream preset on the same networks (reconfigure), tiny config."""
    from lab import data
    from lab.avatar import avatar_loop
    from lab.pipelines import config
    from lab.pipelines import latentsync as P

    a, sr = data.default_audio()
    eng = P.build(config("latentsync", "upstream", size="tiny", block=8), "cuda")
    avatar = P.prepare(eng, avatar_loop(4, (128, 192)))
    ref = P.run(eng, avatar, a[:int(sr * 0.8)], sr, keep_faces=True)
    exact = config("latentsync", "exact", device="cuda", size="tiny", block=8)
    assert "triton_temporal_attention" in exact.techniques and exact.runtime == "compile+graph"
    eng = P.reconfigure(eng, **exact.changes())
    out = P.run(eng, avatar, a[:int(sr * 0.8)], sr, keep_faces=True)
    assert cosine(out.latents, ref.latents) > 0.9999


def test_fp8_linear_runs_true_fp8_gemms_compiled_in_the_graph_runner(monkeypatch):
    """`fp8_linear` on an FP8 GPU: real `_scaled_mm` layers (not emulated) in the exact stack's compiled CUDA-graph
    runner, as far from the fp16 eager UNet as its own eager FP8 model is and no farther from that model than the
    model is from itself when its input moves by one fp16 step. A stack of static FP8 casts lifts any rounding change
    (the compiler's fused kernels round differently) to the FP8 noise itself: on the tiny UNet in float32 a 1e-7
    relative nudge of the input moves the eager FP8 output to cosine ~0.997, so closeness to the eager FP8 model
    to fp16 rounding is no test."""
    from lab.pipelines import latentsync as P
    from lab.pipelines.latentsync.config import EXACT_TECHNIQUES
    from lab.techniques import fp8, fp8_static

    if not fp8.fp8_supported("cuda")[0]:
        pytest.skip(fp8.fp8_supported("cuda")[1])
    monkeypatch.setattr(fp8_static, "MIN_GAIN", 1e-6)   # every Linear FP8: the tiny UNet's GEMMs are too small to pay
    cfg = P.Config(size="tiny", mode="ddim2", block=16, techniques=EXACT_TECHNIQUES)
    eng = P.build(cfg, "cuda")
    ex = sampling.guided_example(eng.unet.model, 16, (8, 8), "cuda", torch.float16, seed=3)
    with torch.inference_mode():
        ref = eng.unet.model(*ex).float()
    q = P.reconfigure(eng, techniques=EXACT_TECHNIQUES + ("fp8_linear",), runtime="compile+graph")
    twins = [m for m in q.unet.model.modules() if isinstance(m, fp8.FP8Linear)]
    assert twins and not any(t.emulate for t in twins) and fp8_static.rewritten(q.unet.model)
    with torch.inference_mode():
        eager = P.eager_unet(q)(*ex).float()
        nudged = P.eager_unet(q)(ex[0] * (1 + 2 ** -10), *ex[1:]).float()   # one fp16 step
        out = q.unet_fn(*ex).float()
    assert 0.99 < cosine(eager, ref) < 0.99999 and 0.99 < cosine(out, ref) < 0.99999   # FP8 in both, not fp16
    assert 1 - cosine(out, ref) < 2 * (1 - cosine(eager, ref))
    assert 1 - cosine(out, eager) < 2 * (1 - cosine(nudged, eager)) + 1e-4


def test_graph_conv_runner_computes_the_exact_runner_and_builds_every_graph():
    """`graph_conv` on the GPU: the UNet's convs and ResNet skips as cuDNN graphs inside the compiled CUDA-graph
    runner (none fell back to torch), the same function as the exact runner to fp16 rounding."""
    from lab.pipelines import latentsync as P
    from lab.pipelines.latentsync.config import EXACT_TECHNIQUES
    from lab.runtime import cudnn_graph

    ok, why = cudnn_graph.available("cuda", "fp16")
    if not ok:
        pytest.skip(why)
    eng = P.build(P.Config(size="tiny", mode="ddim2", block=16, techniques=EXACT_TECHNIQUES), "cuda")
    ex = sampling.guided_example(eng.unet.model, 16, (8, 8), "cuda", torch.float16, seed=3)
    with torch.inference_mode():
        ref = P.eager_unet(eng)(*ex).float()
    cudnn_graph.NOTES.clear()
    g = P.reconfigure(eng, techniques=EXACT_TECHNIQUES + ("graph_conv",), runtime="compile+graph")
    with torch.inference_mode():
        out = g.unet_fn(*ex).float()
    assert cudnn_graph.notes() == []
    assert cosine(out, ref) > 0.9999
