"""Ditto networks: full-size keys/shapes/parameter counts against the released checkpoints' key list
(meta device), tiny-size forward shapes, the loaders' key layouts (wrappers, `module.` prefixes,
spectral norm) and their errors, spectral-norm folding, HuBERT chunking, the LMDM schedule."""
from pathlib import Path

import pytest
import torch

from lab.techniques.spectral_fold import fold_spectral_norm, has_spectral_norm
from lab.errors import InputError, WeightsError
from lab.models import ditto as D

pytestmark = pytest.mark.usefixtures("one_thread")

KEYS_TSV = Path(__file__).resolve().parent / "data" / "ditto_state_dict_keys.tsv"  # the released checkpoints' keys
TSV_NAME = {"lmdm": "lmdm.model"}
# parameter counts of the upstream classes built with their default arguments (LMDM with cond 1103)
UPSTREAM_PARAMS = {"appearance_extractor": 836_224, "motion_extractor": 28_118_728, "warp_network": 45_529_829,
                   "decoder": 55_365_388, "stitch_network": 45_249, "lmdm": 47_788_297}


def _reference() -> dict[str, dict[str, tuple[int, ...]]]:
    ref: dict[str, dict[str, tuple[int, ...]]] = {}
    for line in KEYS_TSV.read_text().splitlines():
        comp, key, shape = line.split("\t")
        ref.setdefault(comp, {})[key] = tuple(int(s) for s in shape.strip("()").split(",") if s.strip())
    return ref


@pytest.mark.parametrize("component", D.COMPONENTS)
def test_full_size_keys_shapes_and_params_match_release(component):
    m = D.build(component, "full", device="meta")
    own = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    ref = _reference()[TSV_NAME.get(component, component)]
    assert set(own) == set(ref), (sorted(set(ref) - set(own))[:5], sorted(set(own) - set(ref))[:5])
    assert {k: (own[k], ref[k]) for k in ref if own[k] != ref[k]} == {}
    assert D.param_count(m) == UPSTREAM_PARAMS[component]


def test_reference_list_is_complete():
    assert sum(len(v) for v in _reference().values()) == 855


def test_decoder_keeps_spectral_norm_keys_and_dense_motion_count():
    dec = D.build("decoder", "full", device="meta")
    keys = dec.state_dict()
    assert "G_middle_0.conv_0.weight_orig" in keys and "up_0.conv_s.weight_v" in keys
    assert "G_middle_0.conv_0.weight" not in keys
    warp = D.build("warp_network", "full", device="meta")
    assert D.param_count(warp.dense_motion_network) == 44_283_621


def test_hubert_is_large_shaped():
    from transformers import HubertModel

    with torch.device("meta"):
        m = HubertModel(D.hubert_config("full"))
    assert m.config.hidden_size == 1024 and m.config.num_hidden_layers == 24
    assert 310e6 < D.param_count(m) < 320e6


@pytest.fixture(scope="module")
def tiny():
    return {c: D.build(c, "tiny", seed=i) for i, c in enumerate(D.COMPONENTS)}


def test_tiny_forward_shapes(tiny):
    d = D.dims("tiny")
    x = torch.rand(2, 3, d.image, d.image)
    with torch.no_grad():
        fs = tiny["appearance_extractor"](x)
        assert fs.shape == (2, d.reshape_channel, d.reshape_depth, d.feature_hw, d.feature_hw)
        pitch, yaw, roll, t, exp, scale, kp = tiny["motion_extractor"](x)
        assert pitch.shape == (2, 66) and t.shape == (2, 3) and exp.shape == (2, 63) and scale.shape == (2, 1)
        m = D.extractor_to_motion(pitch, yaw, roll, t, exp, scale)
        assert m.shape == (2, D.MOTION_DIM)
        kp_s = D.motion_to_keypoints(m, kp)
        kp_d = tiny["stitch_network"](kp_s, kp_s + 0.01)
        assert kp_d.shape == (2, 21, 3)
        feat = tiny["warp_network"](fs, kp_s, kp_d)
        assert feat.shape == (2, d.warp_out, d.feature_hw, d.feature_hw)
        img = tiny["decoder"](feat)
        assert img.shape == (2, 3, d.render_hw, d.render_hw)
        assert 0 <= img.min() and img.max() <= 1 and img.std() > 1e-3   # random σ-settled decoder is not degenerate
        L = d.seq_frames
        x0 = tiny["lmdm"](torch.randn(2, L, 265), torch.randn(2, 265), torch.randn(2, L, d.cond_dim),
                          torch.tensor([999, 3]), torch.tensor([True, False]))
        assert x0.shape == (2, L, 265)


def test_lmdm_sampler_arrangement_is_the_forward(tiny):
    # FiLMs and cross-attention keys / values once per window, q|k as one GEMM, batch-first attention:
    # every step's x0 equals the module's forward up to fp32 rounding
    d = D.dims("tiny")
    lm, L = tiny["lmdm"], d.seq_frames
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        enc = lm.encode_condition(torch.randn(1, L, d.cond_dim, generator=g).expand(2, -1, -1), torch.tensor([True, False]))
        times = torch.tensor([[999, 999], [480, 480], [0, 0]])
        films, keys, values = D.window_constants(lm, enc, times, D.film_weights(lm))
        assert films.shape == (3, 2, d.lm_layers, 3, 2, d.lm_latent) and keys.shape == (3, d.lm_layers, 2, L + 2, d.lm_latent)
        x, cf = torch.randn(2, L, 265, generator=g), torch.randn(2, 265, generator=g)
        for i in range(3):
            ref = lm(x, cf, None, times[i], encoded=enc)
            got = D.sampler_forward(lm, x, cf, films[i], keys[i], values[i])
            assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)
        # one half alone (guidance as two calls) slices the same constants
        half = D.sampler_forward(lm, x[1:], cf[1:], films[0, 1:], keys[0, :, 1:], values[0, :, 1:])
        assert torch.allclose(half, lm(x[1:], cf[1:], None, times[0, 1:], encoded=(enc[0][1:], enc[1][1:])), atol=1e-5)


def test_lmdm_condition_and_null_embedding_matter(tiny):
    d = D.dims("tiny")
    lm = tiny["lmdm"]
    x, cf, c = torch.randn(1, d.seq_frames, 265), torch.randn(1, 265), torch.randn(1, d.seq_frames, d.cond_dim)
    t = torch.tensor([500])
    with torch.no_grad():
        a = lm(x, cf, c, t, torch.tensor([False]))
        b = lm(x, cf, c + 1, t, torch.tensor([False]))
        u1 = lm(x, cf, c, t, torch.tensor([True]))
        u2 = lm(x, cf, c + 1, t, torch.tensor([True]))
        batched = lm(x.expand(2, -1, -1), cf.expand(2, -1), c.expand(2, -1, -1), t.expand(2), torch.tensor([True, False]))
    assert (a - b).abs().max() > 1e-4          # the condition reaches the output
    assert torch.allclose(u1, u2, atol=1e-5)   # dropped condition → the null embedding: c is ignored
    assert torch.allclose(batched[1:], a, atol=1e-5) and torch.allclose(batched[:1], u1, atol=1e-5)


def test_keypoints_identity_pose():
    m = torch.zeros(1, 265)
    m[:, D.M_PITCH] = m[:, D.M_YAW] = m[:, D.M_ROLL] = -1e4
    m[:, 1 + 32] = m[:, 67 + 32] = m[:, 133 + 32] = 0          # bin 32.5 ≈ 0°: bins 32 and 33 equal
    m[:, 1 + 33] = m[:, 67 + 33] = m[:, 133 + 33] = 0
    kp = torch.randn(1, 63)
    out = D.motion_to_keypoints(m, kp)
    assert torch.allclose(out, kp.view(1, 21, 3), atol=1e-5)   # scale 1, no rotation, no exp, no t
    r = D.rotation_matrix(torch.tensor([10.0]), torch.tensor([20.0]), torch.tensor([30.0]))
    assert torch.allclose(r[0] @ r[0].T, torch.eye(3), atol=1e-6)


def test_schedule_times_and_ddim_last_step():
    s = D.Schedule.make(10)
    assert s.times == [999, 899, 799, 699, 599, 499, 399, 299, 199, 99, -1]
    assert D.Schedule.make(50).times[:3] == [999, 979, 959]
    x0 = torch.randn(3)
    assert torch.equal(D.ddim_step(torch.randn(3), x0, 0.5, None, torch.randn(3)), x0)
    with pytest.raises(InputError, match="sampling steps"):
        D.Schedule.make(0)


def test_hubert_lands_on_the_requested_device():
    m, src = D.load_hubert("random", "tiny", device="meta", dtype=torch.float16)
    assert src == "random (seed 0)"
    assert {p.device.type for p in m.parameters()} == {"meta"} and {p.dtype for p in m.parameters()} == {torch.float16}


def test_hubert_streaming_chunks():
    a = torch.arange(16000, dtype=torch.float32)
    ch = D.hubert_chunks(a, 25)
    assert ch.shape == (5, 6480)
    # 3 frames of past padding and the 80 extra samples in front (the upstream parity fixture pins this too)
    assert torch.all(ch[0, :2000] == 0) and ch[0, 2000] == 0 and ch[0, 2001] == 1
    assert ch[1, 0] == 3200 - 2000                                                    # 5 frames (3200 samples) per call
    hub, _ = D.load_hubert("random", "tiny")
    f1 = D.hubert_features(hub, a / 16000, 25, batch=1)
    f4 = D.hubert_features(hub, a / 16000, 25, batch=4)
    assert f1.shape == (25, D.dims("tiny").audio_dim)
    assert torch.allclose(f1, f4, atol=1e-4)


def test_spectral_norm_fold_is_the_same_function(tiny):
    import copy

    dec = copy.deepcopy(tiny["decoder"])
    d = D.dims("tiny")
    x = torch.randn(1, d.warp_out, d.feature_hw, d.feature_hw)
    with torch.no_grad():
        ref = dec(x)
        assert has_spectral_norm(dec)
        assert fold_spectral_norm(dec) == 2 * d.dec_middle + 6
        assert not has_spectral_norm(dec)
        assert torch.allclose(dec(x), ref, atol=1e-6)
    assert not any(k.endswith("weight_orig") for k in dec.state_dict())


# ---------------------------------------------------------------- loaders

def _save(tmp_path: Path, name: str, obj) -> Path:
    p = tmp_path / name
    torch.save(obj, p)
    return p


def test_loaders_take_the_released_layouts(tiny, tmp_path):
    for comp in ("appearance_extractor", "decoder"):
        p = _save(tmp_path, f"{comp}.pth", tiny[comp].state_dict())
        m, src = D.load_component(comp, p, "tiny", seed=99)
        assert src.startswith("local file")
        for k, v in tiny[comp].state_dict().items():
            assert torch.equal(m.state_dict()[k], v), k
    # stitching: {'retarget_shoulder': state dict with DDP module. prefixes}
    sd = {f"module.{k}": v for k, v in tiny["stitch_network"].state_dict().items()}
    p = _save(tmp_path, "stitch_network.pth", {"retarget_shoulder": sd})
    m, _ = D.load_component("stitch_network", p, "tiny", seed=99)
    assert torch.equal(m.mlp[0].weight, tiny["stitch_network"].mlp[0].weight)
    # LMDM: {'model_state_dict': ...}; a folder is searched for the released file name
    _save(tmp_path, "lmdm_v0.4_hubert.pth", {"model_state_dict": tiny["lmdm"].state_dict()})
    m, _ = D.load_component("lmdm", tmp_path, "tiny", seed=99)
    assert torch.equal(m.null_cond_embed, tiny["lmdm"].null_cond_embed)


def test_loader_refuses_non_finite_weights(tiny, tmp_path):
    """A decoder checkpoint with an all-NaN conv used to load, and the run "succeeded" with NaN PSNRs."""
    sd = {k: v.clone() for k, v in tiny["decoder"].state_dict().items()}
    key = next(k for k, v in sd.items() if v.is_floating_point() and v.dim() == 4)
    sd[key].fill_(float("nan"))
    p = _save(tmp_path, "decoder.pth", sd)
    with pytest.raises(WeightsError, match=rf"decoder.pth: holds non-finite weights, first at {key}"):
        D.load_component("decoder", p, "tiny")
    sd = {"model_state_dict": {k: v.clone() for k, v in tiny["lmdm"].state_dict().items()}}
    key = next(k for k, v in sd["model_state_dict"].items() if v.is_floating_point())
    sd["model_state_dict"][key].view(-1)[0] = float("inf")
    with pytest.raises(WeightsError, match=rf"first at {key} \(1 of"):
        D.load_component("lmdm", _save(tmp_path, "lmdm_v0.4_hubert.pth", sd), "tiny")


def test_loader_errors_name_the_keys(tiny, tmp_path):
    sd = dict(tiny["decoder"].state_dict())
    sd.pop("fc.bias")
    sd["extra.weight"] = torch.zeros(1)
    with pytest.raises(WeightsError, match=r"1 missing keys \(e.g. \['fc.bias'\]\).*1 unexpected keys \(e.g. \['extra.weight'\]\)"):
        D.load_component("decoder", _save(tmp_path, "a.pth", sd), "tiny")
    sd = dict(tiny["decoder"].state_dict())
    sd["G_middle_0.conv_0.weight_v"] = torch.zeros(3)
    with pytest.raises(WeightsError, match=r"mis-shaped.*G_middle_0.conv_0.weight_v"):
        D.load_component("decoder", _save(tmp_path, "b.pth", sd), "tiny")
    with pytest.raises(WeightsError, match="retarget_shoulder"):
        D.load_component("stitch_network", _save(tmp_path, "c.pth", tiny["stitch_network"].state_dict()), "tiny")
    with pytest.raises(WeightsError, match="not found"):
        D.load_component("decoder", tmp_path / "missing.pth", "tiny")
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(WeightsError, match="not a readable checkpoint"):
        D.load_component("decoder", tmp_path / "junk.pth", "tiny")
    with pytest.raises(InputError, match="unknown Ditto component"):
        D.build("renderer")
    with pytest.raises(InputError, match="size"):
        D.dims("huge")
    # a full-size checkpoint does not load into the tiny network: shapes named
    with pytest.raises(WeightsError, match="mis-shaped"):
        D.load_component("stitch_network", _save(tmp_path, "d.pth", {"retarget_shoulder": D.build("stitch_network", "full").state_dict()}), "tiny")


def test_channel_padding_is_the_same_function(tiny):
    import copy

    from lab.techniques.channel_pad import PaddedConv, pad_conv_channels

    warp = copy.deepcopy(tiny["warp_network"])
    d = D.dims("tiny")
    fs = torch.randn(2, d.reshape_channel, d.reshape_depth, d.feature_hw, d.feature_hw)
    kp = 0.3 * torch.randn(2, 21, 3)
    with torch.no_grad():
        ref = warp(fs, kp, kp + 0.05)
        names = pad_conv_channels(warp)
        out = warp(fs, kp, kp + 0.05)
    # hourglass input (110 + …), its last conv, the 7³ mask conv (22 out): padded; 1-channel occlusion: too costly
    assert "dense_motion_network.mask" in names and "dense_motion_network.occlusion" not in names
    assert isinstance(warp.dense_motion_network.mask, PaddedConv) and warp.dense_motion_network.mask.weight.shape[0] == 24
    assert torch.allclose(out, ref, atol=1e-5)
    full = D.build("warp_network", "full", device="meta")
    assert sorted(pad_conv_channels(full)) == ["dense_motion_network.hourglass.decoder.conv",
                                               "dense_motion_network.hourglass.encoder.down_blocks.0.conv",
                                               "dense_motion_network.mask"]
    assert full.dense_motion_network.mask.weight.shape == (24, 144, 7, 7, 7)


def test_lmdm_condition_encoded_once_is_the_same_forward(tiny):
    net = tiny["lmdm"]
    d = D.dims("tiny")
    g = torch.Generator().manual_seed(0)
    x, cf = torch.randn(2, d.seq_frames, 265, generator=g), torch.randn(2, 265, generator=g)
    c = torch.randn(2, d.seq_frames, d.cond_dim, generator=g)
    t, drop = torch.tensor([5, 900]), torch.tensor([True, False])
    with torch.no_grad():
        ref = net(x, cf, c, t, drop)
        enc = net.encode_condition(c, drop)
        assert torch.equal(net(x, cf, None, t, drop, encoded=enc), ref)
        assert torch.equal(net(x, cf, c, t, drop), ref)           # the rotary tables, cached, give the same numbers
    assert not any("_tables" in k for k in net.state_dict())


def test_fused_motion_mix_gives_the_same_deformation():
    # the pipeline's faces barely follow the keypoints with random weights, so the mix is checked where it is made
    torch.manual_seed(0)
    dm = D.build("warp_network", "tiny").eval().dense_motion_network
    d = D.dims("tiny")
    feat = torch.randn(2, d.reshape_channel, d.reshape_depth, d.feature_hw, d.feature_hw)
    kp_s = 0.3 * torch.randn(2, D.NUM_KP, 3)
    kp_d = kp_s + 0.1 * torch.randn_like(kp_s)
    with torch.no_grad():
        ref, occ = dm(feat, kp_s, kp_d)
        dm.fused_mix = True
        got, occ2 = dm(feat, kp_s, kp_d)
    assert torch.equal(occ, occ2)
    assert torch.allclose(got, ref, atol=1e-6)
    assert not torch.allclose(ref, dm(feat, kp_s, kp_s)[0], atol=1e-3)   # the deformation follows the keypoints


def test_smoothed_rows_is_a_truncated_three_frame_mean():
    # the window reads only the rows around [s, e): the same as averaging each row's neighbours directly
    t = torch.randn(300, D.MOTION_DIM)
    for s, e, n in [(0, 80, 80), (70, 81, 150), (0, 150, 150), (148, 150, 150), (0, 1, 1)]:
        got = D.smoothed_rows(t, s, e, n)
        for i in (s, (s + e) // 2, e - 1):
            want = t[max(0, i - 1):min(n, i + 2), :D.POSE_DIMS].double().mean(0).float()
            assert torch.allclose(got[i - s, :D.POSE_DIMS], want, atol=1e-6), (s, e, n, i)
            assert torch.equal(got[i - s, D.POSE_DIMS:], t[i, D.POSE_DIMS:])
