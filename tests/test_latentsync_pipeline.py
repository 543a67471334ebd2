"""Tiny LatentSync pipeline on CPU: streaming blocks, ping-pong, the short last block, bad inputs."""
import dataclasses

import numpy as np
import pytest
import torch

from lab import data
from lab.errors import InputError, WeightsError
from lab.pipelines import latentsync as P
from lab.avatar import avatar_loop

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def engine():
    return P.build(P.Config(size="tiny", mode="ddim2", block=4))


@pytest.fixture(scope="module")
def clip():
    a, sr = data.default_audio()
    return a[:int(sr * 0.4)], sr  # 10 frames at 25 fps


@pytest.fixture(scope="module")
def frames():
    return avatar_loop(3, (128, 192))


def _job(engine, frames, clip):
    return P.make_job(engine, P.prepare(engine, frames), *clip)


def _run(engine, job, keep_faces=False, **changes):
    before = engine.cfg
    e = P.reconfigure(engine, **changes)
    out = []
    rep = P.run(e, None, job=job, sink=out.append, keep_faces=keep_faces)
    assert engine.cfg is before   # the engine reconfigured from keeps its own configuration
    return rep, np.concatenate(out)


def test_streams_every_frame_and_keeps_the_background(engine, clip, frames):
    job = _job(engine, frames, clip)
    assert job.n_out == 10 and job.tokens.shape == (10, 50, 64)
    rep, out = _run(engine, job, keep_faces=True)
    assert out.shape == (10, 192, 128, 3) and rep.blocks == 3 and rep.n_frames == 10
    assert rep.counts == {"blocks": 3, "unet_calls": 6, "unet_full_calls": 6} and rep.first_frame_s <= rep.wall_s
    assert rep.faces.shape == (10, 3, 64, 64) and rep.latents.shape == (10, 4, 8, 8)
    src = frames[job.source_index(np.arange(10))]
    changed = np.abs(out.astype(int) - src.astype(int)).max(-1) > 2
    ys, xs = np.nonzero(changed.any(0))
    assert changed.mean() > 0.005                     # the mouth region was regenerated
    assert ys.min() > 10 and ys.max() < 150 and xs.min() > 10 and xs.max() < 118  # and nothing far from the face
    rep2, out2 = _run(engine, job)
    assert np.array_equal(out, out2)                  # same seed, same video
    assert set(rep.stages) >= {"align", "vae_encode", "unet", "vae_decode", "restore"}


def test_pingpong_when_video_is_shorter(engine, clip, frames):
    job = _job(engine, frames, clip)
    assert list(job.source_index(np.arange(10))) == [0, 1, 2, 2, 1, 0, 0, 1, 2, 2]
    single = _job(engine, frames[:1], clip)
    assert set(single.source_index(np.arange(10))) == {0}


def test_short_last_block_changes_its_statistics(engine, clip, frames):
    """10 frames in blocks of 4: the last block has 2 frames. 'short' runs it at 2 frames (upstream):
    its ResNet GroupNorms pool over 2 frames instead of 4, so its frames differ from 'pad'."""
    job = _job(engine, frames, clip)
    short, _ = _run(engine, job, keep_faces=True, last_block="short")
    pad, _ = _run(engine, job, keep_faces=True, last_block="pad")
    assert torch.equal(short.latents[:8], pad.latents[:8])
    d = (short.latents[8:] - pad.latents[8:]).norm() / pad.latents[8:].norm()
    assert d > 1e-3


def test_modes_share_the_noise(engine, clip, frames):
    job = _job(engine, frames, clip)
    a, _ = _run(engine, job, keep_faces=True, mode="ddim2")
    b, _ = _run(engine, job, keep_faces=True, mode="dpm2")
    assert torch.isfinite(b.latents).all() and not torch.equal(a.latents, b.latents)
    assert torch.equal(job.noise[:, :, 0], job.noise[:, :, -1])


def test_bad_inputs(engine, clip, frames):
    with pytest.raises(InputError, match="at most 24"):
        P.Config(block=25).check()
    with pytest.raises(InputError, match="sampling mode"):
        P.Config(mode="fast").check()
    avatar = P.prepare(engine, frames)
    with pytest.raises(InputError, match="silent"):
        P.make_job(engine, avatar, np.zeros(16000, np.float32), 16000)
    quiet = P.reconfigure(engine, allow_silence=True)
    assert P.make_job(quiet, avatar, np.zeros(8000, np.float32), 16000).n_out == 12
    with pytest.raises(InputError, match="silent"):   # the engine it came from still refuses silence
        P.make_job(engine, avatar, np.zeros(16000, np.float32), 16000)
    with pytest.raises(InputError, match="uint8"):
        P.prepare(engine, frames.astype(np.float32))
    with pytest.raises(InputError, match="points"):
        P.prepare(engine, frames, points=np.zeros((2, 3, 2)))
    with pytest.raises(InputError, match="no face"):
        P.prepare(engine, np.zeros_like(frames))
    with pytest.raises(InputError, match="needs audio"):
        P.run(engine, avatar)


def test_wrong_checkpoint_is_refused(tmp_path):
    path = tmp_path / "latentsync_unet.pt"
    torch.save({"state_dict": {"conv_in.weight": torch.zeros(320, 9, 3, 3)}}, path)
    with pytest.raises(WeightsError, match="conv_in.weight"):
        P.build(P.Config(size="tiny", weights={"unet": str(path)}))


def test_openai_whisper_checkpoint_loads_into_the_encoder(tmp_path):
    """LatentSync ships Whisper in OpenAI's layout (checkpoints/whisper/tiny.pt: dims + model_state_dict)."""
    from lab.models.whisper import WHISPER_TEST
    from lab.parity.core import fill_state_dict
    from lab.parity.latentsync import OPENAI_TINY, openai_whisper_keys

    dims = dict(OPENAI_TINY, n_audio_state=WHISPER_TEST["d_model"], n_audio_head=WHISPER_TEST["encoder_attention_heads"])
    sd = fill_state_dict({k: torch.empty(s) for k, s in openai_whisper_keys(dims).items()})
    sd["decoder.token_embedding.weight"] = torch.zeros(3, dims["n_audio_state"])  # the decoder: dropped
    path = tmp_path / "tiny.pt"
    torch.save({"dims": dims, "model_state_dict": sd}, path)
    enc, src = P.load_audio_encoder(str(path), size="tiny")
    assert src.startswith("local file")
    assert torch.equal(enc.layers[3].self_attn.k_proj.weight, sd["encoder.blocks.3.attn.key.weight"])
    assert torch.equal(enc.embed_positions.weight, sd["encoder.positional_embedding"])
    del sd["encoder.ln_post.bias"]
    torch.save({"dims": dims, "model_state_dict": sd}, path)
    with pytest.raises(WeightsError, match="layer_norm.bias"):
        P.load_audio_encoder(str(path), size="tiny")


def test_alignment_roundtrip():
    """align then restore with the same transform gives back the frame inside the face region."""
    img = torch.nn.functional.interpolate(torch.rand(1, 3, 6, 5), size=(96, 80), mode="bilinear")  # smooth
    t = P.face_transforms(P.box_points((20, 20, 60, 60))[None], 64)
    face = P.align(img, t, 64)
    back = P.restore(img * 0, face, t)
    inner = back[:, :, 40:55, 30:50]
    assert torch.allclose(inner, img[:, :, 40:55, 30:50], atol=0.03)
    m = P.similarity(P.TEMPLATE, P.TEMPLATE * 2 + 5)
    assert np.allclose(m, [[2, 0, 5], [0, 2, 5]], atol=1e-5)  # fp32, as upstream computes it


def test_render_writes_the_video(engine, clip, frames, tmp_path):
    from lab.video import read_video_info

    rep = P.run(engine, P.prepare(engine, frames), *clip, out_path=str(tmp_path / "out.mp4"))
    info = read_video_info(tmp_path / "out.mp4")
    assert rep.n_frames == 10 and info.n_frames == 10 and info.has_audio and abs(info.fps - 25) < 1e-6


def test_notebook_parameters_checked_before_any_work():
    from lab.experiments import latentsync as X

    for bad, match in ((dict(n_frames=0), "n_frames"), (dict(weights={"unet2": "x"}), "weights"),
                       (dict(quick="yes"), "quick")):
        with pytest.raises(InputError, match=match):
            X.setup(**bad)


def test_exact_switches_keep_the_output_and_the_encode_cache_hits(clip, frames):
    eng = P.build(P.Config(size="tiny", mode="ddim2", block=4))
    job = _job(eng, frames, clip)                       # 3 source frames looped to 10
    ref = P.run(eng, None, job=job, keep_faces=True)
    fast_eng = P.build(P.Config(size="tiny", mode="ddim2", block=4,
                                techniques=("guided_shortcuts", "fused_qkv", "cache_encodes", "folded_upsamplers"),
                                attention_kernels={"spatial 8²": "math+pad", "temporal 4²": "flash+pad"}))
    assert fast_eng.unet.model.down_blocks[0].attentions[0].transformer_blocks[0].attn1.kernel == "math+pad"
    from lab.techniques.nearest_conv import FoldedUpsample

    assert sum(isinstance(m, FoldedUpsample) for m in fast_eng.unet.model.modules()) == 3
    calls = []
    enc = fast_eng.vae.model.encode
    fast_eng.vae.model.encode = lambda x: calls.append(len(x)) or enc(x)
    job2 = _job(fast_eng, frames, clip)
    rep = P.run(fast_eng, None, job=job2, keep_faces=True)
    assert sorted(job2.encodes) == [0, 1, 2]
    assert len(calls) < 2 * rep.blocks                 # cached blocks skipped both encodes
    torch.testing.assert_close(rep.latents, ref.latents, rtol=1e-4, atol=1e-4)
    assert np.abs(rep.faces.int() - ref.faces.int()).max() <= 1


def test_vae_runners_take_both_encodes_in_one_call_and_a_short_block_padded(clip, frames):
    eng = P.build(P.Config(size="tiny", mode="ddim2", block=4))
    job = _job(eng, frames, clip)                       # 10 frames: blocks of 4, 4, 2
    ref = P.run(eng, None, job=job, keep_faces=True)
    enc, calls = eng.vae.encoder_module(), []
    dec, dec_calls = eng.vae.decoder_module(), []
    # plain modules stand in for the compiled / captured runners (those need a GPU; tested there)
    fast = P.reconfigure(eng, techniques=("vae_runtime",), runners={"vae": (lambda z: dec_calls.append(len(z)) or dec(z),
                                                                            lambda x: calls.append(x.clone()) or enc(x))})
    eager_calls = []
    plain = eng.vae.model.encode
    eng.vae.model.encode = lambda x: eager_calls.append(len(x)) or plain(x)
    try:
        rep = P.run(fast, None, job=job, keep_faces=True)
    finally:
        eng.vae.model.encode = plain
    eng = P.reconfigure(fast, techniques=(), runners={"vae": None})
    # every block one call of 2 × 4 images, the last block's 2 faces padded by repeating the last one; none eager
    assert [len(x) for x in calls] == [8, 8, 8] and eager_calls == [] and dec_calls == [4, 4, 4]
    last = calls[-1]
    assert torch.equal(last[2], last[1]) and torch.equal(last[3], last[1]) and torch.equal(last[6], last[5])
    assert eng.vae_encode is None and eng.vae_decode is None and eng.cfg.techniques == ()
    torch.testing.assert_close(rep.latents, ref.latents, rtol=1e-4, atol=1e-4)
    assert rep.n_frames == 10 and np.abs(rep.faces.int() - ref.faces.int()).max() <= 1   # the padding is dropped


def test_feature_cache_mode_runs_its_two_step_runners_and_a_short_block_eager(clip, frames):
    from lab.pipelines.latentsync import sampling

    eng = P.build(P.Config(size="tiny", mode="deepcache3", block=4))
    job = _job(eng, frames, clip)                       # 10 frames: blocks of 4, 4, 2
    ref = P.run(eng, None, job=job, keep_faces=True)
    model, calls = eng.unet.model, []
    full, shallow = sampling.DeepStep(model, True, True), sampling.ShallowStep(model, True)
    # plain modules stand in for the compiled / captured runners (those need a GPU; tested there)
    runners = (lambda *a: calls.append("full") or full(*a), lambda *a: calls.append("shallow") or shallow(*a))
    fast = P.reconfigure(eng, runtime="compile", techniques=("guided_shortcuts",), runners={"cache": runners})
    rep = P.run(fast, None, job=job, keep_faces=True)
    assert calls.count("full") == 2 * 7 and calls.count("shallow") == 2 * 13   # the two full blocks only
    assert rep.counts["unet_full_calls"] == 3 * 7 and rep.counts["unet_calls"] == 3 * 20
    fast.cfg.mode = "exact20"    # a mode of the other kind set behind reconfigure's back: no runner for it
    with pytest.raises(InputError, match="reconfigure"):
        P.run(fast, None, job=job)
    eng = P.reconfigure(fast, mode="deepcache3", runtime="eager", techniques=())
    assert eng.cache_runners is None and eng.runner is None and eng.cfg.runtime == "eager"
    torch.testing.assert_close(rep.latents, ref.latents, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("size", ["tiny", "full"])
def test_temporal_kernels_name_every_temporal_shape_of_the_unet(size):
    from lab.models import latentsync as lsm

    kernels = P.temporal_kernels(size, "math")
    with torch.device("meta"):   # the full UNet's shapes without allocating it
        model = lsm.UNet3D(lsm.CONFIGS[size])
    latent = P.Config(size=size).face // 8
    assert set(kernels) == {label for label, _ in lsm.attention_sites(model, latent) if label.startswith("temporal")}
    lsm.set_attention_kernels(model, per_shape=kernels, latent=latent)
    assert {m.kernel for label, m in lsm.attention_sites(model, latent) if label.startswith("temporal")} == {"math"}
    assert P.temporal_kernels(size) == dict.fromkeys(kernels, "triton")


def test_encoder_module_is_the_encode_path():
    from lab.models.vae import load_vae, posterior

    vae = load_vae("sd-vae", size="tiny")
    x = torch.rand(3, 3, 64, 64) * 2 - 1
    d = vae.model.encode(x).latent_dist
    p = posterior(vae.encoder_module()(x))
    torch.testing.assert_close(p.mean, d.mean)
    torch.testing.assert_close(p.std, d.std)
    with pytest.raises(InputError, match="only the SD-VAE"):
        load_vae("taesd", size="tiny").encoder_module()


def test_attention_shapes_cover_the_step_and_padding_keeps_the_result():
    from lab.experiments.latentsync import attention_kernel_rows, attention_shapes
    from lab.models.latentsync import FULL, TINY, attention_sites, build_unet

    shapes = attention_shapes(FULL)
    calls = {s["attention"]: s["calls"] for s in shapes}
    sites = attention_sites(build_unet("full", device="meta"), 64)
    assert sum(calls.values()) == len(sites) and set(calls) == {label for label, _ in sites}
    assert sum(s["calls"] for s in shapes if s["attention"].startswith("spatial")) == 16  # transformers in the UNet
    assert sum(s["calls"] for s in shapes if s["attention"].startswith("cross")) == 16
    assert sum(s["calls"] for s in shapes if s["attention"].startswith("temporal")) == 2 * 20  # 20 motion modules
    assert {(s["tokens"], s["head_dim"]) for s in shapes if s["attention"].startswith("spatial")} == \
        {(4096, 40), (1024, 80), (256, 160), (64, 160)}
    assert {s["kv_tokens"] for s in shapes if s["attention"].startswith("cross")} == {50}
    rows = attention_kernel_rows(TINY, torch.device("cpu"), torch.float32, 4, 8, iters=1)
    padded = [r for r in rows if r["spec"].endswith("+pad") and r["status"] == "ok"]
    assert padded and all(r["cosine_vs_auto"] > 0.999999 for r in padded)
    assert {r["attention"] for r in rows} == {s["attention"] for s in attention_shapes(TINY, 4, 2, 8)}


def test_kernel_choice_is_the_fastest_explicit_kernel_that_keeps_the_result():
    from lab.experiments.latentsync import attention_choice_ms, choose_attention_kernels

    def row(shape, spec, ms, cos=1.0, compiled=False, status="ok"):
        return {"attention": shape, "spec": spec, "ms_per_call": ms, "ms_per_step": 2 * ms, "cosine_vs_auto": cos,
                "compiled": compiled, "status": status}

    rows = [row("spatial 64²", "auto", 1.0), row("spatial 64²", "cudnn", 1.1), row("spatial 64²", "flash+pad", 0.8),
            row("spatial 64²", "efficient", 0.5, cos=0.99),            # wrong result: never chosen
            row("spatial 64²", "math", 0.1, status="unavailable: x"),
            row("temporal 64²", "auto", 0.3), row("temporal 64²", "flash", 0.4), row("temporal 64²", "math", 0.2, compiled=True)]
    assert choose_attention_kernels(rows, compiled=False) == {"spatial 64²": "flash+pad", "temporal 64²": "flash"}
    assert choose_attention_kernels(rows, compiled=True) == {"spatial 64²": "flash+pad", "temporal 64²": "math"}
    assert attention_choice_ms(rows, compiled=True) == pytest.approx({"auto_ms_per_step": 2.6, "chosen_ms_per_step": 2.0})


def test_memory_step_measures_both_last_blocks_after_one_untimed_run(tmp_path, monkeypatch):
    from lab.experiments import latentsync as L

    ctx = L.setup("cpu", quick=True, out_dir=str(tmp_path / "run"))
    seen = []
    run = L._run

    def spy(c, mode, fast, keep=True, job=None, **cfg):
        seen.append(cfg.get("last_block"))
        return run(c, mode, fast, keep, job, **cfg)

    monkeypatch.setattr(L, "_run", spy)
    rows = L.memory_scaling(ctx)
    lo, hi = ctx.prof.memory_seconds
    assert [(r["last_block"], r["input_s"]) for r in rows] == [("short", lo), ("short", hi), ("pad", lo), ("pad", hi)]
    # the warm-up run comes first and is not a row; every run got the last-block rule of its row
    assert seen == ["short", "short", "short", "pad", "pad"]
    assert set(ctx.res.metrics["memory_growth"]) == set(ctx.res.metrics["memory_growth_last_block_padded"]) == {"rss", "gpu"}


def test_step_budget_splits_a_mode_row_into_unet_and_the_rest():
    from lab.experiments import latentsync as X

    # 32 frames (1.28 s of output) in 4.0 s, 3.2 s of it in the UNet, 20 steps per 16-frame block
    b = X.step_budget({"frames": 32, "steps": 20, "unet_s": 3.2, "s_per_output_s": 4.0 / 1.28}, 2.5, 16)
    assert b["unet_s_per_output_s"] == pytest.approx(2.5)
    assert b["rest_s_per_output_s"] == pytest.approx(0.625)
    assert b["ms_per_step_now"] == pytest.approx(80.0)          # 2.5 s / (20 steps · 25/16 blocks per second)
    assert b["ms_per_step_allowed"] == pytest.approx(60.0)      # (2.5 − 0.625) s over the same 31.25 steps
    assert X.step_budget({"frames": 32, "steps": 8, "unet_s": 1.0, "s_per_output_s": 2.0}, 1.0, 16)["ms_per_step_allowed"] < 0


def test_waterfall_builds_the_pdl_row_before_the_comparison_stack(tmp_path, monkeypatch):
    """The PDL candidate is built right after the stack with the pinned kernels, so a deadline cuts the comparison
    stack (without them) first; the table shows the PDL row last. Builds are stood in by the plain model."""
    from lab.runtime import pdl
    from lab.experiments import latentsync as L

    ctx = L.setup("cpu", quick=True, out_dir=str(tmp_path / "run"))
    ctx.prof.fast = [*L.LEVERS, "compile", "compile+cudagraph"]
    built = []

    def runner(target, how):
        built.append(how)
        return type("Runner", (), {"notes": [], "__call__": lambda self, *a: target(*a)})()

    monkeypatch.setattr(L, "_build_runner", lambda target, how, ex, dtype, compiled=None: runner(target, how))
    monkeypatch.setattr(L.sampling, "fast_unet", lambda target, how, ex, precision, pdl: runner(target, how + " PDL"))
    monkeypatch.setattr(pdl, "supported", lambda: True)
    checks = []   # the deadline: in time for the pinned stack and the PDL row, out of time for the comparison
    monkeypatch.setattr(L, "_no_time_for_a_compile", lambda c: checks.append(1) or ("late" if len(checks) > 2 else None))
    rows = L.step_waterfall(ctx)
    assert built == ["compile", "compile+cudagraph PDL"]   # on a CPU the graph row itself is skipped ("needs CUDA")
    assert rows[-1]["step"].endswith("attention kernels + PDL") and rows[-1]["status"] == "ok"
    late = [r["step"] for r in rows if r["status"] == "late"]
    assert late and all("attention kernels" not in s for s in late)   # the comparison stack was the one cut
    pinned = [r for r in rows if r["step"].startswith("compile +") and "attention kernels" in r["step"]]
    assert len(pinned) == 1 and pinned[0]["status"] == "ok"


def test_job_costs_a_new_process_loads_the_checkpoint_and_keeps_its_engine(tmp_path, monkeypatch):
    from lab.experiments import latentsync as X

    ctx = X.setup("cpu", quick=True, out_dir=str(tmp_path / "run"))
    rows = X.job_costs(ctx)
    assert [r["status"] for r in rows] == ["ok", "ok"]
    m = ctx.res.metrics["jobs"]
    assert m["unet_weights"].startswith("local file") and m["unet_weights"].endswith("latentsync_unet.pt")
    assert m["second_equals_first"] is True                      # the kept engine gives the first job's latents
    assert rows[0]["wall_s"] > rows[1]["wall_s"] and rows[0]["x_kept"] > 1
    assert abs(rows[0]["wall_s"] - (m["import_s"] + m["build_s"] + m["first_job_s"])) < 1e-9
    # a child that fails is a row that says why, not a stack trace
    from lab.experiments import latentsync_jobs as J

    monkeypatch.setattr(J, "_child", lambda env: (1, ["Traceback …", "WeightsError: bad"]))
    assert X.job_costs(ctx) == [{"job": "a job in a new process", "status": "failed: WeightsError: bad"}]


def test_a_technique_missing_its_requirement_is_refused_with_its_name():
    with pytest.raises(InputError, match="'pdl' needs a runtime with 'graph'"):
        P.Config(techniques=("pdl",)).check()
    with pytest.raises(InputError, match="no technique 'vae_fast'"):
        P.Config(techniques=("vae_fast",)).check()
    with pytest.raises(InputError, match="'triton_temporal_attention' needs a CUDA device"):
        P.build(P.Config(size="tiny", techniques=("triton_temporal_attention",)), "cpu")
    with pytest.raises(InputError, match="runtime='graph'.*CUDA device"):
        P.build(P.Config(size="tiny", runtime="graph"), "cpu")


def test_presets_on_a_cpu_build_and_run_and_exact_keeps_the_output(clip, frames):
    """The presets as a CPU runs them (tiny): what a CPU cannot run is left out; the exact preset's techniques give
    upstream's output, the fast preset another sampler. A preset on a CPU runs eager (torch.compile of the tiny UNet
    takes minutes there; the compiled runners' equality is tested on the GPU host)."""
    from lab.pipelines import config

    cfgs = {name: config("latentsync", name, device="cpu", size="tiny", block=4) for name in ("upstream", "exact", "fast")}
    assert cfgs["exact"].runtime == "eager" and "triton_temporal_attention" not in cfgs["exact"].techniques
    assert config("latentsync", "exact", device="cpu", size="tiny", runtime="compile").runtime == "compile"   # asked for
    assert cfgs["exact"].techniques[:4] == ("channels_last", "guided_shortcuts", "fused_qkv", "fused_norms")
    assert cfgs["upstream"].techniques == () and cfgs["fast"].mode == "dpm4"
    reps = {}
    for name, cfg in cfgs.items():
        eng = P.build(cfg)
        reps[name] = P.run(eng, P.prepare(eng, frames), *clip, max_frames=6, keep_faces=True)
        assert reps[name].n_frames == 6 and reps[name].mode == cfg.mode
    torch.testing.assert_close(reps["exact"].latents, reps["upstream"].latents, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(reps["fast"].latents, reps["upstream"].latents, atol=1e-3)


def test_reconfigure_keeps_the_networks_and_refuses_what_they_were_built_for(engine, clip, frames):
    nets = (engine.unet.model, engine.vae.model, engine.whisper)
    avatar = P.prepare(engine, frames)
    ref = P.run(engine, avatar, *clip, max_frames=4, keep_faces=True)
    shortcuts = P.reconfigure(engine, mode="dpm2", techniques=("guided_shortcuts",))
    # techniques that leave the networks as they are share them; the Whisper encoder is always shared
    assert shortcuts is not engine and (shortcuts.unet.model, shortcuts.vae.model, shortcuts.whisper) == nets
    eng = P.reconfigure(engine, mode="dpm2", techniques=("guided_shortcuts", "fused_qkv", "channels_last"))
    # rewriting techniques get a copy of the networks, made once per form
    assert eng.unet.model is not engine.unet.model and eng.whisper is engine.whisper
    assert P.reconfigure(shortcuts, techniques=("fused_qkv", "channels_last")).unet is eng.unet
    assert eng.unet.model.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    other = P.run(eng, avatar, *clip, max_frames=4, keep_faces=True)
    assert not torch.equal(other.latents, ref.latents)           # another sampler
    for field, value in (("size", "full"), ("seed", 1), ("dtype", "bf16"), ("weights", {"unet": "x.pt"})):
        with pytest.raises(InputError, match=f"cannot change {field}"):
            P.reconfigure(engine, **{field: value})
    with pytest.raises(InputError, match="no field"):
        P.reconfigure(engine, fast="compile")
    # the engine reconfigured from is untouched: its networks, its configuration, its output
    assert engine.cfg.mode == "ddim2" and engine.cfg.techniques == ()
    assert not engine.unet.model.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    again = P.run(engine, avatar, *clip, max_frames=4, keep_faces=True)
    assert torch.equal(again.latents, ref.latents)
    back = P.run(P.reconfigure(eng, mode="ddim2", techniques=()), avatar, *clip, max_frames=4, keep_faces=True)
    assert torch.equal(back.latents, ref.latents)                    # derived back: the same output


def test_prepare_takes_the_bundled_avatar_and_an_image(engine, tmp_path):
    from PIL import Image

    from lab import data

    a = P.prepare(engine)
    assert a.frames.shape == (1, 512, 512, 3) and a.transforms.shape == (1, 2, 3)
    Image.fromarray(data.default_avatar()).save(tmp_path / "face.png")
    b = P.prepare(engine, str(tmp_path / "face.png"))
    assert np.array_equal(a.frames, b.frames) and np.allclose(a.transforms, b.transforms)
