"""LatentSync UNet3D: parity with diffusers' UNetMotionModel (two GroupNorms matched), full-size keys,
shapes and parameter count (meta device), the loader, and bad inputs."""
from pathlib import Path

import pytest
import torch
from torch import nn

from lab.errors import InputError, WeightsError
from lab.models import latentsync as ls

pytestmark = pytest.mark.usefixtures("one_thread")

# the 1246 keys and shapes of the released latentsync_unet.pt, listed from the upstream module definition
KEYS_TSV = Path(__file__).resolve().parent / "data" / "latentsync_unet_state_dict_keys.tsv"


class PerFrameNorm(nn.GroupNorm):
    """diffusers' motion-module norm sees (B, C, F, H, W) and pools over frames; LatentSync's is per frame."""

    def forward(self, x):
        b, c, f, h, w = x.shape
        y = super().forward(x.permute(0, 2, 1, 3, 4).reshape(b * f, c, h, w))
        return y.reshape(b, f, c, h, w).permute(0, 2, 1, 3, 4)


class PooledNorm(nn.GroupNorm):
    """diffusers' ResNet norms see (B·F, C, H, W), per frame; LatentSync's pool over the block's frames."""

    frames = 1

    def forward(self, x):
        bf, c, h, w = x.shape
        f = PooledNorm.frames
        y = super().forward(x.reshape(bf // f, f, c, h, w).transpose(1, 2))
        return y.transpose(1, 2).reshape(bf, c, h, w)


def _swap(module: nn.Module, name: str, cls: type, groups: int | None = None) -> None:
    old = getattr(module, name)
    new = cls(groups or old.num_groups, old.num_channels, eps=old.eps)
    new.load_state_dict(old.state_dict())
    setattr(module, name, new)


def diffusers_reference(cfg: ls.UNet3DConfig, fix_motion_norm: bool, fix_resnet_norm: bool):
    from diffusers import UNetMotionModel
    from diffusers.models.resnet import ResnetBlock2D
    from diffusers.models.unets.unet_motion_model import AnimateDiffTransformer3D

    m = UNetMotionModel(in_channels=cfg.in_channels, out_channels=cfg.out_channels,
                        block_out_channels=cfg.block_out_channels, layers_per_block=cfg.layers_per_block,
                        norm_num_groups=cfg.norm_groups, cross_attention_dim=cfg.cross_attention_dim,
                        num_attention_heads=cfg.heads, motion_num_attention_heads=cfg.motion_heads,
                        use_motion_mid_block=False, motion_max_seq_length=cfg.motion_max_len)
    for mod in list(m.modules()):
        if fix_motion_norm and isinstance(mod, AnimateDiffTransformer3D):
            _swap(mod, "norm", PerFrameNorm, cfg.motion_norm_groups)  # upstream's: 32 whatever norm_num_groups
        if fix_resnet_norm and isinstance(mod, ResnetBlock2D):
            _swap(mod, "norm1", PooledNorm)
            _swap(mod, "norm2", PooledNorm)
    if fix_resnet_norm:
        _swap(m, "conv_norm_out", PooledNorm)
    return m.eval()


@pytest.fixture(scope="module")
def tiny_pair():
    ours = ls.load_latentsync_unet("random", "tiny", seed=3).model
    torch.manual_seed(0)
    frames = 6
    x = torch.randn(2, 13, frames, 16, 16)
    audio = torch.randn(2 * frames, 50, ls.TINY.cross_attention_dim)
    t = torch.tensor([601, 601])
    with torch.no_grad():
        y = ours(x, t, audio)
    return ours, x, t, audio, y


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("fix_motion,fix_resnet,close", [(True, True, True), (False, False, False),
                                                          (True, False, False), (False, True, False)])
def test_parity_with_diffusers_needs_both_norms(tiny_pair, fix_motion, fix_resnet, close):
    ours, x, t, audio, y = tiny_pair
    ref = diffusers_reference(ls.TINY, fix_motion, fix_resnet)
    ref.load_state_dict(ls.to_diffusers_keys(ours.state_dict()), strict=True)  # the keymap is exact
    PooledNorm.frames = x.shape[2]
    with torch.no_grad():
        yr = ref(x, t, encoder_hidden_states=audio).sample
    err = _rel(y, yr)
    if close:
        assert err < 1e-5, err
    else:
        assert err > 1e-3, err  # either GroupNorm left as diffusers has it is a real difference


def test_full_size_keys_shapes_and_count_match_upstream():
    m = ls.build_unet("full", device="meta")  # nothing allocated
    own = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    ref = ls.read_keys_tsv(KEYS_TSV)
    assert len(ref) == 1246
    assert set(own) == set(ref)
    assert {k for k in ref if own[k] != ref[k]} == set()
    assert ls.n_params(m) == ls.FULL_PARAMS == 1_267_099_844
    assert ls.n_params(m, buffers=True) - ls.n_params(m) == 844_800  # the 40 fixed (1, 24, C) pe tables
    assert sum(1 for k in own if k.endswith("pos_encoder.pe")) == 40


def test_output_depends_on_audio_and_frames_are_coupled(tiny_pair):
    ours, x, t, audio, y = tiny_pair
    with torch.no_grad():
        y_null = ours(x, t, torch.zeros_like(audio))
        x2 = x.clone()
        x2[:, :, -1] += 1.0  # change only the last frame
        y2 = ours(x2, t, audio)
    assert _rel(y_null, y) > 1e-3
    # frame 0's output moves: block GroupNorm statistics and temporal attention couple the frames
    assert _rel(y2[:, :, 0], y[:, :, 0]) > 1e-4


def test_audio_shapes(tiny_pair):
    ours, x, t, audio, y = tiny_pair
    b, _, f = x.shape[:3]
    with torch.no_grad():
        y4 = ours(x, t, audio.reshape(b, f, 50, -1))  # (B, F, S, D) is flattened frame-major
    assert torch.equal(y4, y)
    with pytest.raises(InputError, match="65536 vs 4096"):
        ours(x, t, audio[:b])  # one audio row per batch item instead of per frame
    with pytest.raises(InputError, match="per-frame tokens"):
        ours(x, t, audio[..., :-1])


def test_bad_samples(tiny_pair):
    ours, x, t, audio, _ = tiny_pair
    with pytest.raises(InputError, match="at most 24"):
        ours(torch.zeros(1, 13, 25, 16, 16), t[:1], torch.zeros(25, 50, 64))
    with pytest.raises(InputError, match="multiple of"):
        ours(torch.zeros(1, 13, 2, 12, 12), t[:1], torch.zeros(2, 50, 64))
    with pytest.raises(InputError, match="13"):
        ours(torch.zeros(1, 9, 2, 16, 16), t[:1], torch.zeros(2, 50, 64))


def test_loader_roundtrip_reports_keys(tmp_path, tiny_pair):
    ours, x, t, audio, y = tiny_pair
    sd = {k: v.clone() for k, v in ours.state_dict().items()}
    path = tmp_path / "latentsync_unet.pt"
    torch.save({"global_step": 7, "state_dict": sd}, path)
    u = ls.load_latentsync_unet(str(path), "tiny")
    assert u.weights.startswith("local file") and not u.missing and not u.unexpected
    with torch.no_grad():
        assert torch.equal(u(x, t, audio), y)
    # a DDP prefix, a dropped pe table, an extra key: loads, with the differences reported
    sd2 = {"module." + k: v for k, v in sd.items() if not k.endswith("attention_blocks.1.pos_encoder.pe")}
    sd2["module.extra.weight"] = torch.zeros(1)
    torch.save({"state_dict": sd2}, path)
    u2 = ls.load_latentsync_unet(str(path), "tiny")
    assert u2.unexpected == ["extra.weight"] and len(u2.filled) == 12  # one per motion module (tiny: 4 + 8)
    with torch.no_grad():
        assert torch.allclose(u2(x, t, audio), y)
    # missing learned weights: refused unless asked for
    key = next(k for k in sd if k.endswith("conv1.weight"))
    torch.save({"state_dict": {k: v for k, v in sd.items() if k != key}}, path)
    with pytest.raises(WeightsError, match="missing"):
        ls.load_latentsync_unet(str(path), "tiny")
    assert ls.load_latentsync_unet(str(path), "tiny", allow_missing=True).missing == [key]


def test_loader_refuses_non_finite_weights(tmp_path, tiny_pair):
    """A UNet with NaN weights used to load and fail later inside a metric, the file unnamed."""
    ours = tiny_pair[0]
    sd = {k: v.clone() for k, v in ours.state_dict().items()}
    key = next(k for k in sd if k.endswith("conv1.weight"))
    sd[key][0] = float("nan")
    path = tmp_path / "latentsync_unet.pt"
    torch.save({"state_dict": sd}, path)
    with pytest.raises(WeightsError, match=rf"latentsync_unet.pt: holds non-finite weights, first at {key}"):
        ls.load_latentsync_unet(str(path), "tiny")


def test_shared_reader_refuses_non_finite_weights(tmp_path):
    from lab.models.weights import load_into, read_state_dict

    torch.save({"w": torch.ones(2), "b": torch.tensor([1.0, float("-inf")]), "n": torch.tensor([1])}, tmp_path / "m.pt")
    with pytest.raises(WeightsError, match=r"m.pt: holds non-finite weights, first at b \(1 of 2"):
        read_state_dict(tmp_path / "m.pt")
    with pytest.raises(WeightsError, match="non-finite"):
        load_into(nn.Linear(2, 1), tmp_path / "m.pt")
    torch.save({"w": torch.ones(2), "n": torch.tensor([1])}, tmp_path / "ok.pt")
    assert set(read_state_dict(tmp_path / "ok.pt")) == {"w", "n"}


def test_loader_rejects_wrong_shapes_and_files(tmp_path, tiny_pair):
    ours = tiny_pair[0]
    path = tmp_path / "unet.pt"
    torch.save({"state_dict": ours.state_dict()}, path)
    with pytest.raises(WeightsError, match="do not match"):
        ls.load_latentsync_unet(str(path), "full")  # a tiny checkpoint into the full config (meta build: cheap)
    with pytest.raises(WeightsError, match="not found"):
        ls.load_latentsync_unet(str(tmp_path / "nope.pt"), "tiny")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(WeightsError, match="not a readable"):
        ls.load_latentsync_unet(str(tmp_path / "junk.pt"), "tiny")
    with pytest.raises(InputError, match="size"):
        ls.load_latentsync_unet("random", "huge")


def test_shallow_branch_reproduces_the_full_call_on_its_own_features(tiny_pair):
    ours, x, t, audio, y = tiny_pair
    feats = {}
    with torch.no_grad():
        y_full = ours(x, t, audio, features=feats)
        y_shallow = ours.forward_shallow(x, t, audio, feats["deep"])
        y_stale = ours.forward_shallow(x + 0.5, t, audio, feats["deep"])
    assert torch.equal(y_full, y)
    assert torch.allclose(y_shallow, y, atol=1e-5)          # same input: the cache loses nothing
    assert _rel(y_stale, ours(x + 0.5, t, audio)) > 1e-3     # stale deep features: an approximation


def test_feature_cache_schedule(tiny_pair):
    from lab.pipelines.latentsync import sampling as smp

    ours = tiny_pair[0]
    f = 2  # small shapes: 4 × 20 UNet calls
    lat = smp.initial_noise((1, 4, 8, 8), f, seed=0)
    cond = torch.randn(1, 9, f, 8, 8)
    audio = torch.randn(f, 50, ls.TINY.cross_attention_dim)
    cache = smp.feature_cache(ours, 3)
    with torch.no_grad():
        a = smp.denoise(cache, lat, cond, audio, "deepcache3")
        assert cache.full_calls == 7                          # steps 0, 3, …, 18 of 20
        b = smp.denoise(cache, lat, cond, audio, "deepcache3")   # next block: reset
        exact = smp.denoise(ours, lat, cond, audio, "exact20")
    assert cache.full_calls == 14 and torch.equal(a, b)
    assert 1e-6 < _rel(a, exact) < 0.5
    assert smp.parse_mode("deepcache3") == smp.Mode("deepcache3", "ddim", 20, 3)


def test_feature_cache_under_dpm_solver(tiny_pair):
    from lab.pipelines.latentsync import sampling as smp

    ours = tiny_pair[0]
    f = 2
    lat = smp.initial_noise((1, 4, 8, 8), f, seed=0)
    cond = torch.randn(1, 9, f, 8, 8)
    audio = torch.randn(f, 50, ls.TINY.cross_attention_dim)
    with torch.no_grad():
        plain = smp.denoise(ours, lat, cond, audio, "dpm8")
        for k, calls in ((2, 4), (3, 3)):                      # steps 0, 2, 4, 6 / 0, 3, 6 of 8
            cache = smp.feature_cache(ours, k)
            a = smp.denoise(cache, lat, cond, audio, f"dpm8+deepcache{k}")
            assert cache.full_calls == calls
            b = smp.denoise(cache, lat, cond, audio, f"dpm8+deepcache{k}")   # the solver's history reset per block
            assert cache.full_calls == 2 * calls and torch.equal(a, b)
            assert 1e-6 < _rel(a, plain) < 0.5
        one = smp.feature_cache(ours, 1)                       # every step full: the plain sampler, bit for bit
        assert torch.equal(smp.denoise(one, lat, cond, audio, "dpm8+deepcache1"), plain)


def test_feature_cache_steps_with_the_guided_shortcuts_compute_the_same():
    from lab.pipelines.latentsync import sampling as smp

    m = ls.load_latentsync_unet("random", "tiny", seed=5).model
    x, t, a = _guided(m)
    with torch.no_grad():
        eps, deep = smp.DeepStep(m)(x, t, a)
        eps_s, deep_s = smp.DeepStep(m, True, True)(x, t, a)
        # fp32 round-off only: eps has std ≈ 0.34, and the tiny config's motion norms (upstream's 32 groups
        # over 32-64 channels) normalise one or two channels each, which magnifies the reordered sums
        torch.testing.assert_close(eps_s, eps, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(deep_s, deep, rtol=1e-5, atol=1e-4)
        assert deep.shape[0] == x.shape[0] * x.shape[2]          # both halves' features, frames folded in
        x2 = x + 0.25                                              # a later step: the kept features are stale
        plain = smp.ShallowStep(m)(x2, t, a, deep)
        # the null half's cross-attention is to_out's bias in the shallow layer too: bit for bit
        assert torch.equal(smp.ShallowStep(m, null_audio=True)(x2, t, a, deep), plain)
        # a layout the shortcut does not hold for gives another answer
        a_bad = torch.cat([a[len(a) // 2:], a[len(a) // 2:]])
        assert (smp.ShallowStep(m, True)(x2, t, a_bad, deep) - smp.ShallowStep(m)(x2, t, a_bad, deep)).abs().max() > 1e-3
        assert (smp.DeepStep(m, True, True)(x, t, a_bad)[0] - smp.DeepStep(m)(x, t, a_bad)[0]).abs().max() > 1e-3
        f = x.shape[2]
        lat = smp.initial_noise((1, 4, 8, 8), f, seed=1)
        cond = x[1:, 4:]
        ref = smp.denoise(smp.feature_cache(m, 3), lat, cond, a[len(a) // 2:], "deepcache3")
        fast = smp.denoise(smp.feature_cache(m, 3, shortcuts=True), lat, cond, a[len(a) // 2:], "deepcache3")
    torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-4)
    with pytest.raises(InputError, match="even"):
        m.forward_shallow(x[:1], t[:1], a[: len(a) // 2], deep[: len(deep) // 2], null_audio=True)
    with pytest.raises(InputError, match="interval"):
        smp.FeatureCache(0, m, m)


def test_attention_kernels_per_kind_keep_the_output(tiny_pair):
    ours, x, t, audio, y = tiny_pair
    try:
        ls.set_attention_kernels(ours, spatial="math", temporal="math", cross="math")
        with torch.no_grad():
            y2 = ours(x, t, audio)
    finally:
        ls.set_attention_kernels(ours)
    assert torch.allclose(y2, y, atol=1e-5)
    assert all(m.kernel is None for m in ours.modules() if isinstance(m, ls.Attention))
    with pytest.raises(InputError, match="temporal"):
        ls.set_attention_kernels(ours, temporal="fastest")


def test_attention_kernels_per_shape_padded_and_in_one_graph():
    from lab.pipelines.latentsync import sampling as sampling

    m = ls.load_latentsync_unet("random", "tiny", seed=2).model
    sites = ls.attention_sites(m, latent=8)
    labels = sorted({label for label, _ in sites})
    assert len(sites) == sum(isinstance(x, ls.Attention) for x in m.modules())   # every attention has a shape
    x, t, a = sampling.guided_example(m, 4, (8, 8), "cpu", torch.float32)
    with torch.no_grad():
        ref = m(x, t, a)
    specs = {label: ("math+pad", "flash+pad", "math")[i % 3] for i, label in enumerate(labels)}
    ls.set_attention_kernels(m, spatial="math", per_shape=specs, latent=8)
    assert all(mod.kernel == specs[label] and mod.backend in ("math", "flash") for label, mod in sites)
    assert sum(mod.pad for _, mod in sites) > 0
    with torch.no_grad():  # zero-padded head dims (tiny: 16 → 64) compute the same attention
        torch.testing.assert_close(m(x, t, a), ref, rtol=1e-5, atol=1e-5)
        # the kernel choice is a constant at trace time: one graph through resnet, spatial, cross, temporal
        blk, f, temb = m.down_blocks[0], 4, m._embed(x, t)
        h0 = m.conv_in(x.transpose(1, 2).reshape(8, 13, 8, 8))
        layer = torch.compile(lambda h, e, au: blk.layer(0, h, e, au, f), fullgraph=True, backend="eager")
        torch.testing.assert_close(layer(h0, temb, a), blk.layer(0, h0, temb, a, f))
    ls.set_attention_kernels(m)
    assert all(mod.kernel is None and not mod.pad for _, mod in sites)
    with pytest.raises(InputError, match="not in this UNet"):
        ls.set_attention_kernels(m, per_shape={"spatial 64²": "cudnn"}, latent=8)
    with pytest.raises(InputError, match="cudnn\\+wide"):
        ls.set_attention_kernels(m, per_shape={labels[0]: "cudnn+wide"}, latent=8)


def test_a_compiled_attention_keeps_the_kernel_it_was_traced_with():
    graphs = []

    def record(gm, example):
        graphs.append({n.target for n in gm.graph.nodes if n.op == "call_function"})
        return gm.forward

    att = ls.Attention(32, 2)
    x = torch.randn(2, 16, 32)
    fn = torch.compile(att, backend=record, fullgraph=True)
    with torch.no_grad():
        for spec in ("math", None, "math", "math+pad"):
            att.set_kernel(spec)
            torch.testing.assert_close(fn(x), att(x))
    # a new choice is a new trace (guarded), an earlier one is found again; padding is in the graph
    assert len(graphs) == 3 and sum(any("pad" in str(t) for t in g) for g in graphs) == 1


def _guided(m, seed=0):
    from lab.pipelines.latentsync import sampling as sampling

    x, t, a = sampling.example_inputs(m, 1, 4, (8, 8), "cpu", torch.float32, seed=seed)
    return torch.cat([x, x]), torch.cat([t, t]), torch.cat([torch.zeros_like(a), a])


def test_guided_shortcuts_and_fused_qkv_compute_the_same():
    from lab.models.latentsync import fuse_qkv, load_latentsync_unet

    m = load_latentsync_unet("random", "tiny", seed=3).model
    assert all(mod.to_k.bias is None and mod.to_v.bias is None for mod in m.modules() if hasattr(mod, "to_k"))
    x, t, a = _guided(m)
    with torch.no_grad():
        ref = m(x, t, a)
        # the null half of each audio cross-attention is to_out's bias: bit for bit
        assert torch.equal(m(x, t, a, null_audio=True), ref)
        # fp32 round-off of the half-batch prefix (see the feature-cache test above for the tolerance)
        for kw in ({"shared_prefix": True}, {"null_audio": True, "shared_prefix": True}):
            torch.testing.assert_close(m(x, t, a, **kw), ref, rtol=1e-5, atol=1e-4)
        n, keys = sum(p.numel() for p in m.parameters()), set(m.state_dict())
        fuse_qkv(m)
        assert sum(p.numel() for p in m.parameters()) == n and set(m.state_dict()) == keys
        torch.testing.assert_close(m(x, t, a, null_audio=True, shared_prefix=True), ref, rtol=1e-5, atol=1e-4)
        # the shortcuts rest on the guided layout: a batch that breaks it gives another answer
        a_bad = a.clone()
        a_bad[: len(a) // 2] = a[len(a) // 2:]
        assert (m(x, t, a_bad, null_audio=True) - m(x, t, a_bad)).abs().max() > 1e-3
        x_bad = x.clone()
        x_bad[0] = torch.randn_like(x[0])
        assert (m(x_bad, t, a, shared_prefix=True) - m(x_bad, t, a)).abs().max() > 1e-3
    with pytest.raises(InputError, match="even"):
        m(x[:1], t[:1], a[: len(a) // 2], null_audio=True)
