"""The SD-VAE decoder's convs as cuDNN graph convs (lab.techniques.graph_conv): on the CPU, the rewrite keeps the
function (bit-equal in fp32, where the torch ops run) and routes each resnet block's skip add into conv2's epilogue
(fp16, where the graph op's torch fallback runs); the GPU tests time nothing, they check the built graphs."""
import copy

import pytest
import torch
from torch import nn

from lab.errors import InputError
from lab.runtime import cudnn_graph
from lab.techniques import check, registry
from lab.techniques import graph_conv as gc


def _vae():
    from lab.models.vae import load_vae

    return load_vae("sd-vae", "random", size="tiny")


def test_fp32_rewrite_is_bit_equal_and_keeps_the_keys():
    vae = _vae()
    ref = vae.decoder_module().eval()
    g = copy.deepcopy(vae)
    rows = gc.graph_convs(g.model.decoder)
    n_res = sum(1 for r in rows if r["became"].startswith("GraphResnet"))
    assert n_res == len([m for m in vae.model.decoder.modules() if type(m).__name__ == "ResnetBlock2D"]) > 0
    assert any(r["became"] == "GraphConv2d" for r in rows)
    z = torch.randn(2, 4, 8, 8)
    with torch.no_grad():
        assert torch.equal(g.decoder_module().eval()(z), ref(z))
    assert g.model.decoder.state_dict().keys() == vae.model.decoder.state_dict().keys()


def test_fp16_skip_runs_in_conv2s_epilogue(monkeypatch):
    vae = _vae()
    g = copy.deepcopy(vae)
    gc.graph_convs(g.model.decoder)
    g.model.half()
    specs = []
    real = cudnn_graph.conv2d
    monkeypatch.setattr(cudnn_graph, "conv2d", lambda x, w, spec, **kw: specs.append(spec.epilogue) or real(x, w, spec, **kw))
    z = torch.randn(2, 4, 8, 8)
    with torch.no_grad():
        got = g.decoder_module().eval()(z.half()).float()
        want = vae.decoder_module().eval()(z)
    n_res = len([m for m in g.model.decoder.modules() if isinstance(m, gc.GraphResnet)])
    assert specs.count(("bias", "add")) == n_res
    assert len(specs) > n_res
    assert float((got - want).abs().max()) < 2e-2   # fp16 rounding of a tiny decoder's outputs in [0, 1]


def test_ineligible_convs_stay_with_a_reason():
    ok, why = gc.eligible(nn.Conv2d(4, 16, 3, padding=1))
    assert not ok and "multiples of 8" in why
    assert not gc.eligible(nn.Conv2d(16, 16, 3, padding=1, groups=2))[0]
    assert not gc.eligible(nn.ConvTranspose2d(16, 16, 4, stride=2, padding=1))[0]
    rows = gc.graph_convs(_vae().model.decoder)
    conv_in = [r for r in rows if r["module"] == "conv_in"]
    assert conv_in and not conv_in[0]["became"] and "channels" in conv_in[0]["reason"]
    with pytest.raises(ValueError, match="multiples of 8"):
        gc.GraphConv2d(nn.Conv2d(4, 16, 3))


def test_registered_as_an_exact_musetalk_technique():
    t = registry("musetalk")["graph_conv"]
    assert t.exact and "graph_conv" in t.where
    assert check("musetalk", ("subpixel", "fused_norm", "graph_conv")) == ("subpixel", "fused_norm", "graph_conv")
    with pytest.raises(InputError, match="graph_conv"):
        check("musetalk", "graph_conv")


def test_plain_convs_undoes_the_rewrite():
    vae = _vae()
    g = copy.deepcopy(vae)
    rows = gc.graph_convs(g.model.decoder)
    assert gc.plain_convs(g.model.decoder) == sum(1 for r in rows if r["became"]) > 0
    kinds = [type(m).__name__ for m in g.model.decoder.modules()]
    assert "GraphResnet" not in kinds and "GraphConv2d" not in kinds
    assert [type(m).__name__ for m in vae.model.decoder.modules()] == kinds
    assert gc.plain_convs(g.model.decoder) == 0


def test_pipeline_switch_same_frames_and_back():
    import numpy as np

    from lab.pipelines import Encode
    from lab.pipelines import musetalk as mt

    cfg = mt.Config(size="tiny", frame_size=(128, 192), crop=64, batch_size=4, encode=Encode(writer="null", queue=3),
                    face_crop="geometric", techniques=("subpixel", "fused_norm"))
    e = mt.build(cfg, "cpu")
    av = mt.prepare(e, mt.avatar_loop(6, (128, 192)))
    on = mt.reconfigure(e, techniques=("subpixel", "fused_norm", "graph_conv"))
    assert any(isinstance(m, gc.GraphResnet) for m in on.decoder.modules())
    assert not any(isinstance(m, gc.GraphResnet) for m in e.decoder.modules())
    off = mt.reconfigure(on, techniques=("subpixel", "fused_norm"))
    assert off.decoder is e.decoder
    z = torch.randn(4, 4, 16, 16)
    with torch.no_grad():
        assert torch.equal(on.decoder(z), e.decoder(z))
    built = mt.build(mt.Config(**{**cfg.__dict__, "techniques": ("graph_conv",)}), "cpu")
    assert any(isinstance(m, gc.GraphConv2d) for m in built.decoder.modules())
    unfused = mt.reconfigure(built, techniques=("fused_norm",))   # a graphed build, its copy made plain then fused
    assert not any(isinstance(m, gc.GraphConv2d) for m in unfused.decoder.modules())
    audio = (0.1 * np.random.default_rng(0).standard_normal(24000)).astype(np.float32)
    rep = mt.run(on, av, audio, 24000, n_frames=8)
    assert rep.n_frames == 8
    # the decoder's first and last convs (4 and 3 channels) stay torch convs, and the run says so
    assert any(n.startswith("graph_conv: ") and "conv_out" in n and "VAE decoder" in n for n in rep.notes)
    assert not mt.run(e, av, audio, 24000, n_frames=8).notes


def _fused_ditto_decoder(fold_shortcut: bool):
    from lab.models import ditto as D
    from lab.techniques.spade_fuse import fuse_spade
    from lab.techniques.spectral_fold import fold_spectral_norm

    torch.manual_seed(0)
    dec, _ = D.load_component("decoder", "random", "tiny", seed=3)
    fold_spectral_norm(dec)
    return fuse_spade(dec, lowres_seg=True, fold_shortcut=fold_shortcut).eval(), D.dims("tiny")


@pytest.mark.parametrize("fold_shortcut", [False, True])
def test_ditto_decoder_with_graph_convs_is_the_same_function(fold_shortcut, monkeypatch):
    fused, d = _fused_ditto_decoder(fold_shortcut)
    g = copy.deepcopy(fused)
    rows = gc.graph_spade(g)
    blocks = [m for m in g.modules() if type(m).__name__ == "FusedBlock"]
    assert blocks and all(b.skip_in_conv for b in blocks)
    assert sum(1 for r in rows if r["became"]) > 2 * len(blocks)
    x = torch.randn(2, d.warp_out, d.feature_hw, d.feature_hw)
    with torch.no_grad():
        assert torch.equal(g(x), fused(x))   # fp32: the torch ops, the skip added in the same order
    specs = []
    real = cudnn_graph.conv2d
    monkeypatch.setattr(cudnn_graph, "conv2d", lambda x, w, spec, **kw: specs.append(spec.epilogue) or real(x, w, spec, **kw))
    with torch.no_grad():
        got, want = copy.deepcopy(g).half()(x.half()).float(), fused(x)
    learned = sum(1 for b in blocks if b.learned_shortcut)
    assert learned > 0 and specs.count(("bias", "add")) == len(blocks)               # conv_1 + the block's skip
    assert specs.count(("add",)) == (learned if fold_shortcut else 0)              # a folded conv_s + its β
    assert float((got - want).abs().max()) < 2e-2
    assert gc.plain_convs(g) > 0 and not any(b.skip_in_conv for b in blocks)
    with torch.no_grad():
        assert torch.equal(g(x), fused(x))


def test_ditto_engine_switches_graph_convs_on_the_merged_decoder():
    from lab.pipelines import ditto

    t = registry("ditto")["graph_conv"]
    assert t.exact and t.requires == ("fuse_spade",)
    with pytest.raises(InputError, match="fuse_spade"):
        check("ditto", ("fold_spectral_norm", "graph_conv"))
    assert "graph_conv" in ditto.config.RENDERER_TECHNIQUES
    from lab.pipelines.ditto.engine import _module

    eng = ditto.build(ditto.Config(size="tiny", precision="fp32", batch_size=2, frame_size=(128, 192)), "cpu")
    on = ("fold_spectral_norm", "fuse_spade", "graph_conv")
    assert not _module(eng, "decoder", "fp32", on).fc.weight.is_contiguous(memory_format=torch.channels_last)
    eng.device = torch.device("cuda")      # as a GPU engine decides it: the graphs take NHWC operands
    assert _module(eng, "decoder", "fp32", on).fc.weight.is_contiguous(memory_format=torch.channels_last)


def test_a_cuda_module_without_the_backend_is_refused_at_the_rewrite(monkeypatch):
    from lab.errors import BackendUnavailable

    def missing(device, io):
        raise BackendUnavailable("cuDNN graphs need the nvidia-cudnn-frontend wheel")

    class OnGpu(nn.Module):
        def parameters(self, recurse=True):
            yield type("P", (), {"is_cuda": True, "device": torch.device("cuda", 0)})()

    monkeypatch.setattr(cudnn_graph, "require", missing)
    with pytest.raises(BackendUnavailable, match="nvidia-cudnn-frontend"):
        gc.graph_convs(OnGpu())
    with pytest.raises(BackendUnavailable, match="nvidia-cudnn-frontend"):
        gc.graph_spade(OnGpu())
    gc.require_for(nn.Conv2d(8, 8, 1))          # on the CPU: nothing to check


def test_latentsync_resnet_blocks_hand_their_skip_to_a_graph_conv(monkeypatch):
    """LatentSync's ResnetBlock3D gives its skip to a conv2 that adds residuals in its epilogue (fp16: the graph
    op's torch fallback runs here), and computes the same block (bit-equal in fp32)."""
    from lab.models.latentsync import ResnetBlock3D, tiny_config

    torch.manual_seed(0)
    cfg = tiny_config()
    blk = ResnetBlock3D(32, 64, cfg).eval()
    x, temb = torch.randn(4, 32, 8, 8), torch.randn(2, cfg.time_dim)
    with torch.no_grad():
        ref = blk(x, temb, 2)
    g = copy.deepcopy(blk)
    rows = gc.graph_convs(g)
    assert {r["module"] for r in rows if r["became"] == "GraphConv2d"} == {"conv1", "conv2", "conv_shortcut"}
    with torch.no_grad():
        assert torch.equal(g(x, temb, 2), ref)
    g.half()
    specs = []
    real = cudnn_graph.conv2d
    monkeypatch.setattr(cudnn_graph, "conv2d", lambda x, w, spec, **kw: specs.append(spec.epilogue) or real(x, w, spec, **kw))
    with torch.no_grad():
        got = g(x.half(), temb.half(), 2).float()
    assert specs == [("bias",), ("bias",), ("bias", "add")]      # conv1, the shortcut, conv2 with the skip
    assert float((got - ref).abs().max()) < 2e-2 * float(ref.abs().max())


def test_latentsync_engine_switches_graph_convs_on_the_unet_and_the_vae():
    from lab.pipelines.latentsync import engine as E
    from lab.pipelines.latentsync.config import Config

    assert registry("latentsync")["graph_conv"].exact
    eng = E.build(Config(size="tiny", block=4))
    ex = E.sampling.guided_example(eng.unet.model, 4, (8, 8), "cpu", eng.dtype, seed=5)
    with torch.no_grad():
        ref = eng.unet.model(*ex).clone()
    g = E.reconfigure(eng, techniques=("graph_conv",))
    assert g.unet.model is not eng.unet.model                    # a copy of the networks for this form
    assert sum(isinstance(m, gc.GraphConv2d) for m in g.unet.model.modules()) > 10
    assert sum(isinstance(m, gc.GraphResnet) for m in g.vae.model.modules()) > 0
    assert g.built_for["vae"][-1] is True                         # the VAE's runners are rebuilt for the switch
    said = " ".join(g.notes["graph_conv"])
    assert "of the UNet" in said and "of the SD-VAE" in said and "conv_out" in said
    with torch.no_grad():
        assert torch.equal(g.unet.model(*ex), ref)
    first = E.build(Config(size="tiny", block=4, techniques=("graph_conv",)))   # built graphed, then undone
    back = E.reconfigure(first, techniques=())
    assert back.unet.model is not first.unet.model
    assert not any(isinstance(m, (gc.GraphConv2d, gc.GraphResnet)) for n in (back.unet.model, back.vae.model)
                   for m in n.modules())
    with torch.no_grad():
        assert torch.equal(back.unet.model(*ex), ref)


def test_a_run_notes_the_layers_a_technique_left_and_the_shapes_cudnn_declined(monkeypatch):
    import sys

    from lab.pipelines import engine_notes
    from lab.runtime import cudnn_graph
    from lab.techniques import left_as_is

    rows = [{"module": "a", "became": "GraphConv2d", "reason": ""},
            {"module": "conv_in", "became": "", "reason": "4 → 64 channels"},
            {"module": "conv_out", "became": "", "reason": "64 → 3 channels"},
            {"layer": "fc", "fp8": False, "reason": "not a GEMM shape"},
            {"layer": "fc2", "fp8": True, "reason": ""}]
    assert left_as_is(rows, "decoder") == ["1 layer of the decoder left as it was (conv_in): 4 → 64 channels",
                                           "1 layer of the decoder left as it was (conv_out): 64 → 3 channels",
                                           "1 layer of the decoder left as it was (fc): not a GEMM shape"]
    many = [{"module": f"c{i}", "became": "", "reason": "grouped"} for i in range(5)]
    assert left_as_is(many) == ["5 layers left as they were (c0, c1, c2 and 2 more): grouped"]
    notes = {"graph_conv": ["x"], "other": ["y"]}
    monkeypatch.setattr(cudnn_graph, "NOTES", {"conv k3": "no engine for this shape"})
    assert engine_notes(("graph_conv",), notes, ("graph_conv",)) == [
        "graph_conv: x", "cuDNN graph declined, torch ran it: conv k3: no engine for this shape"]
    assert engine_notes(("other",), notes, ("graph_conv",)) == ["other: y"]   # no cuDNN technique asked for
    monkeypatch.delitem(sys.modules, "lab.runtime.cudnn_graph")
    assert engine_notes(("graph_conv",), notes, ("graph_conv",)) == ["graph_conv: x"]
