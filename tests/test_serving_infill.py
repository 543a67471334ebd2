"""Frame skip + infill: plan checks, flow warping on a known shift, the RIFE-shaped net."""
import numpy as np
import pytest
import torch

from lab.serving import infill
from lab.errors import InputError

pytestmark = pytest.mark.usefixtures("one_thread")


def test_stride_larger_than_clip_is_refused():
    with pytest.raises(InputError, match="larger than the clip"):
        infill.check_plan(5, 8)
    with pytest.raises(InputError, match="larger than the clip"):
        infill.check_plan(4, 4)
    with pytest.raises(InputError, match="positive integer"):
        infill.check_plan(10, 0)
    with pytest.raises(InputError, match="at least one frame"):
        infill.check_plan(0, 2)
    assert infill.check_plan(9, 4).tolist() == [0, 4, 8]


def _texture(shift: float, size: int = 96) -> np.ndarray:
    y, x = np.mgrid[0:size, 0:size].astype(np.float32)
    x = x - shift
    img = 127 + 60 * np.sin(x / 5.0) * np.cos(y / 7.0) + 50 * np.sin((x + y) / 11.0)
    return np.repeat(np.clip(img, 0, 255).astype(np.uint8)[..., None], 3, axis=2)


@pytest.mark.parametrize("estimator", infill.ESTIMATORS)
def test_flow_infill_follows_a_translation(estimator):
    frames = np.stack([_texture(s) for s in (0, 1, 2, 3, 4)])        # 1 px per frame
    keys = infill.check_plan(5, 4)
    out = infill.flow_infill(frames[keys], keys, 5, estimator)
    inner = (slice(8, -8), slice(8, -8))
    err_flow = np.abs(out[2][inner].astype(float) - frames[2][inner]).mean()
    lerp = (frames[0].astype(float) + frames[4]) / 2
    err_lerp = np.abs(lerp[inner] - frames[2][inner]).mean()
    assert np.array_equal(out[keys], frames[keys])
    assert err_flow < 0.35 * err_lerp, (err_flow, err_lerp)


def test_flow_rejects_bad_frames_and_estimator():
    with pytest.raises(InputError, match="RGB uint8"):
        infill.optical_flow(np.zeros((8, 8)), np.zeros((8, 8)))
    with pytest.raises(InputError, match="estimator"):
        infill.optical_flow(_texture(0), _texture(1), "raft")


def test_warp_zero_flow_is_identity_and_shift_moves():
    img = torch.rand(1, 3, 16, 16)
    assert torch.allclose(infill.warp(img, torch.zeros(1, 2, 16, 16)), img, atol=1e-6)
    f = torch.zeros(1, 2, 16, 16)
    f[:, 0] = 1.0
    assert torch.allclose(infill.warp(img, f)[..., :-1], img[..., 1:], atol=1e-5)


def test_ifnet_shapes_and_rife_infill():
    net = infill.ifnet("tiny")
    a, b = torch.rand(2, 3, 64, 64), torch.rand(2, 3, 64, 64)
    assert net(a, b, torch.tensor([0.25, 0.5])).shape == (2, 3, 64, 64)
    with pytest.raises(InputError, match="divisible by 32"):
        net(torch.rand(1, 3, 48, 40), torch.rand(1, 3, 48, 40))
    keys = infill.check_plan(9, 4)
    k = torch.rand(keys.size, 3, 32, 32)
    out = infill.rife_infill(net, k, keys, 9, batch=4)
    assert out.shape == (9, 3, 32, 32) and torch.equal(out[torch.as_tensor(keys)], k)
