"""The explicit denoising loop against an independent DDIM / CFG computation, and scheduler resets."""
import math

import pytest
import torch

from lab.pipelines.latentsync import sampling as smp
from lab.errors import InputError

B, F, H, W, D = 1, 3, 4, 4, 8


def toy_unet(calls):
    """eps depends on the noisy latents, the conditioning channels, the timestep and the per-frame audio."""
    def fn(x, t, audio):
        calls.append((x.clone(), t.clone(), audio.clone()))
        a = audio.mean(dim=(1, 2)).reshape(x.shape[0], 1, x.shape[2], 1, 1)
        return 0.3 * x[:, :4] - 0.2 * x[:, 4:8] + 0.5 * a + 1e-4 * t.float().reshape(-1, 1, 1, 1, 1)
    return fn


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    lat = smp.initial_noise((B, 4, H, W), F, seed=seed)
    cond = torch.randn(B, 9, F, H, W, generator=g)
    audio = torch.randn(B * F, 5, D, generator=g)
    return lat, cond, audio


def reference_ddim(lat, cond, audio, steps=20, g=1.5):
    """DDIM (η = 0) written out: scaled_linear betas, leading spacing + offset 1, final alpha = ᾱ₀."""
    betas = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000, dtype=torch.float64) ** 2
    ac = torch.cumprod(1 - betas, 0)
    ratio = 1000 // steps
    ts = [i * ratio + 1 for i in reversed(range(steps))]
    x = lat.double()
    for t in ts:
        def eps_of(a):
            s = torch.cat([x, cond.double()], 1)
            m = a.double().mean(dim=(1, 2)).reshape(B, 1, F, 1, 1)
            return 0.3 * s[:, :4] - 0.2 * s[:, 4:8] + 0.5 * m + 1e-4 * t
        eu, ec = eps_of(torch.zeros_like(audio)), eps_of(audio)
        e = eu + g * (ec - eu)
        a_t = ac[t]
        a_p = ac[t - ratio] if t - ratio >= 0 else ac[0]
        x0 = (x - (1 - a_t).sqrt() * e) / a_t.sqrt()
        x = a_p.sqrt() * x0 + (1 - a_p).sqrt() * e
    return x, ts


def test_exact20_matches_written_out_ddim_and_cfg():
    lat, cond, audio = inputs()
    calls = []
    out = smp.denoise(toy_unet(calls), lat, cond, audio, "exact20")
    ref, ts = reference_ddim(lat, cond, audio)
    assert ts[0] == 951 and ts[-1] == 1
    assert [int(c[1][0]) for c in calls] == ts  # one UNet call per step, at upstream's timesteps
    assert torch.allclose(out.double(), ref, atol=1e-5, rtol=1e-5)
    x, t, a = calls[0]
    assert x.shape == (2 * B, 13, F, H, W) and t.shape == (2 * B,)
    assert torch.count_nonzero(a[:B * F]) == 0 and torch.equal(a[B * F:], audio)  # null audio first
    assert torch.equal(x[:B, 4:], x[B:, 4:])


def test_guidance_one_is_a_single_unguided_call():
    lat, cond, audio = inputs()
    calls = []
    out = smp.denoise(toy_unet(calls), lat, cond, audio, "ddim4", guidance=1.0)
    assert calls[0][0].shape[0] == B and torch.equal(calls[0][2], audio)
    ref, _ = reference_ddim(lat, cond, audio, steps=4, g=1.0)
    assert torch.allclose(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_noise_is_one_draw_repeated_over_frames():
    z = smp.initial_noise((1, 4, 5, 5), 16, seed=7)
    assert z.shape == (1, 4, 16, 5, 5)
    assert all(torch.equal(z[:, :, 0], z[:, :, i]) for i in range(16))
    assert torch.equal(z, smp.initial_noise((1, 4, 5, 5), 16, seed=7))
    assert not torch.equal(z, smp.initial_noise((1, 4, 5, 5), 16, seed=8))


@pytest.mark.parametrize("mode", ["dpm8", "dpm4", "ddim12"])
def test_scheduler_state_is_reset_per_block(mode):
    lat, cond, audio = inputs()
    sched = smp.make_scheduler(smp.parse_mode(mode).kind)
    a = smp.denoise(toy_unet([]), lat, cond, audio, mode, scheduler=sched)
    b = smp.denoise(toy_unet([]), lat, cond, audio, mode, scheduler=sched)  # second block, same scheduler
    c = smp.denoise(toy_unet([]), lat, cond, audio, mode)                   # fresh scheduler
    assert torch.equal(a, b) and torch.equal(a, c)
    assert torch.isfinite(a).all()


def test_dpm_matches_diffusers_own_stepping():
    """Our loop over DPM-Solver++ equals stepping the diffusers scheduler by hand (no hidden state kept)."""
    lat, cond, audio = inputs()
    out = smp.denoise(toy_unet([]), lat, cond, audio, "dpm8")
    s = smp.make_scheduler("dpm")
    s.set_timesteps(8)
    x = lat.clone()
    unet = toy_unet([])
    for t in s.timesteps:
        inp = torch.cat([torch.cat([x, cond], 1)] * 2)
        e = unet(inp, t.repeat(2), torch.cat([torch.zeros_like(audio), audio]))
        eu, ec = e.chunk(2)
        x = s.step(eu + 1.5 * (ec - eu), t, x).prev_sample
    assert torch.allclose(out, x, atol=1e-6)
    assert not torch.allclose(out, smp.denoise(toy_unet([]), lat, cond, audio, "exact20"), atol=1e-3)


def test_staging_reused_across_blocks():
    lat, cond, audio = inputs()
    stage = smp.staging(lat, cond, audio, 1.5)
    a = smp.denoise(toy_unet([]), lat, cond, audio, "ddim4", stage=stage)
    lat2, cond2, audio2 = inputs(seed=1)
    b = smp.denoise(toy_unet([]), lat2, cond2, audio2, "ddim4", stage=stage)
    assert torch.equal(b, smp.denoise(toy_unet([]), lat2, cond2, audio2, "ddim4"))
    assert not torch.equal(a, b)


def test_bad_modes_and_shapes():
    for bad in ("exact12", "dpm0", "euler8", "ddim"):
        with pytest.raises(InputError, match="sampling mode"):
            smp.parse_mode(bad)
    assert smp.parse_mode("dpm12") == smp.Mode("dpm12", "dpm", 12)
    for bad in ("deepcache3+deepcache2", "dpm8+deepcache0", "dpm8+", "dpm8+cache3", "dpm0+deepcache2", "exact12+deepcache3"):
        with pytest.raises(InputError, match="sampling mode"):
            smp.parse_mode(bad)
    lat, cond, audio = inputs()
    with pytest.raises(InputError, match="conditioning"):
        smp.denoise(toy_unet([]), lat, cond[:, :, :2], audio)
    with pytest.raises(InputError, match="per-frame tokens"):
        smp.denoise(toy_unet([]), lat, cond, audio[:B])
    with pytest.raises(InputError, match="fast path"):
        smp.fast_unet(torch.nn.Linear(1, 1), "tensorrt", (torch.zeros(1),))
    assert math.isclose(smp.GUIDANCE, 1.5)


def test_a_sampler_combines_with_the_feature_cache():
    assert smp.parse_mode("dpm8+deepcache3") == smp.Mode("dpm8+deepcache3", "dpm", 8, 3)
    assert smp.parse_mode("ddim12+deepcache2") == smp.Mode("ddim12+deepcache2", "ddim", 12, 2)
    assert smp.parse_mode("exact20+deepcache3") == smp.Mode("exact20+deepcache3", "ddim", 20, 3)
    assert not smp.parse_mode("exact20+deepcache3").exact and smp.parse_mode("exact20").exact
    # full UNet calls per block: steps 0, k, 2k, … of N
    assert [smp.parse_mode(m).full_calls for m in ("exact20", "dpm8", "deepcache3", "dpm8+deepcache3", "dpm8+deepcache2")] \
        == [20, 8, 7, 3, 4]


def test_the_sampler_registry_drives_parse_mode_and_the_mode_lists(monkeypatch):
    """A new sampler is one entry in SAMPLERS: parse_mode accepts '<kind><N>' for it (alone and with the feature
    cache), make_scheduler builds it; the lab's mode lists come from MODES and every listed mode parses."""
    made = []
    monkeypatch.setitem(smp.SAMPLERS, "euler", smp.Sampler("euler", "a stand-in", lambda: made.append(1) or smp._ddim()))
    assert smp.parse_mode("euler6") == smp.Mode("euler6", "euler", 6)
    assert smp.parse_mode("euler6+deepcache2").full_calls == 3 and not smp.parse_mode("euler20").exact
    assert smp.make_scheduler("euler") is not None and made == [1]
    monkeypatch.delitem(smp.SAMPLERS, "euler")
    with pytest.raises(InputError, match="'ddim<N>', 'dpm<N>'"):
        smp.parse_mode("euler6")
    with pytest.raises(InputError, match=r"scheduler kind must be one of \('ddim', 'dpm'\)"):
        smp.make_scheduler("euler")
    assert smp.modes()[0] == smp.EXACT and set(smp.modes("full")) <= set(smp.modes("notebook"))
    assert smp.modes("calibrate") == ("exact20", "ddim8", "dpm4")
    assert [r["mode"] for r in smp.mode_rows() if r["exact"]] == ["exact20"]
    with pytest.raises(InputError, match="mode list 'nb'"):
        smp.modes("nb")
    monkeypatch.setitem(smp.MODES, "dpm6", ("compare",))
    assert smp.modes("compare")[-1] == "dpm6"
