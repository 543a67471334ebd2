"""Pyramidal cascade: the compact SR network, its loader, the bicubic baseline."""
import pytest
import torch

from lab.serving import cascade as cs
from lab.errors import InputError, WeightsError

pytestmark = pytest.mark.usefixtures("one_thread")


def test_srvgg_shapes_and_residual_base():
    net, label = cs.load_srvgg("random", upscale=2, num_feat=8, num_conv=2)
    x = torch.rand(2, 3, 16, 12)
    assert label == "random" and net(x).shape == (2, 3, 32, 24)
    with torch.no_grad():
        net.body[-1].weight.zero_()
        net.body[-1].bias.zero_()
    # with the last conv silent the network is the nearest-neighbour upscale it adds back
    assert torch.equal(net(x), torch.nn.functional.interpolate(x, scale_factor=2, mode="nearest"))
    assert [k for k in net.state_dict()][:3] == ["body.0.weight", "body.0.bias", "body.1.weight"]


def test_loader_takes_released_layout_and_names_mismatches(tmp_path):
    net, _ = cs.load_srvgg("random", upscale=4, num_feat=8, num_conv=3, seed=3)
    p = tmp_path / "realesr-compact.pth"
    torch.save({"params_ema": net.state_dict()}, p)
    again, label = cs.load_srvgg(p, upscale=4, num_feat=8, num_conv=3)
    x = torch.rand(1, 3, 8, 8)
    assert label == str(p) and torch.equal(again(x), net(x))
    with pytest.raises(WeightsError, match="does not fit"):
        cs.load_srvgg(p, upscale=4, num_feat=8, num_conv=5)
    with pytest.raises(WeightsError, match="not found"):
        cs.load_srvgg(tmp_path / "none.pth")


def test_bicubic_and_downscale():
    x = torch.rand(1, 3, 8, 8)
    assert cs.bicubic(cs.downscale(x, 2), 2).shape == x.shape
    flat = torch.full((1, 3, 8, 8), 0.5)
    assert torch.allclose(cs.bicubic(cs.downscale(flat, 2), 2), flat)
    with pytest.raises(InputError, match="divisible"):
        cs.downscale(torch.rand(1, 3, 7, 8), 2)
    up = cs.cascade(lambda z: z, lambda z: cs.bicubic(z, 2))
    assert up(x).shape == (1, 3, 16, 16)
