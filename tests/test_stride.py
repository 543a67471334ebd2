"""Cadence strides: SLERP geometry, keyframe plans, vectorized expansion, adaptive plans."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lab.techniques.stride import (adaptive_keyframes, duty_cycle, expand_keyframes, keyframe_indices, lerp,
                              norm_deficit, slerp)
from lab.errors import InputError

FAST = settings(max_examples=40, deadline=None)


def _pair(seed: int, b: int = 3, shape=(4, 5, 5), dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    z0 = torch.randn(b, *shape, generator=g, dtype=torch.float64)
    z1 = torch.randn(b, *shape, generator=g, dtype=torch.float64)
    return z0.to(dtype), z1.to(dtype)


def _norms(z):
    return z.double().flatten(1).norm(dim=1)


# ----------------------------------------------------------------------------- slerp

@FAST
@given(seed=st.integers(0, 10_000), alpha=st.floats(0, 1), scale=st.floats(1e-3, 1e3))
def test_slerp_norm_between_endpoints_and_finite(seed, alpha, scale):
    z0, z1 = _pair(seed)
    z1 = z1 * scale
    out = slerp(z0, z1, alpha)
    assert out.shape == z0.shape and out.dtype == z0.dtype
    assert torch.isfinite(out).all()
    n0, n1, n = _norms(z0), _norms(z1), _norms(out)
    lo, hi = torch.minimum(n0, n1), torch.maximum(n0, n1)
    assert (n >= lo * (1 - 1e-5)).all() and (n <= hi * (1 + 1e-5)).all()
    # the norm is exactly the linearly interpolated one
    torch.testing.assert_close(n, (1 - alpha) * n0 + alpha * n1, rtol=1e-5, atol=0)


@FAST
@given(seed=st.integers(0, 10_000), dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32,
                                                           torch.float64]))
def test_slerp_endpoints_exact_in_every_dtype(seed, dtype):
    z0, z1 = _pair(seed, dtype=dtype)
    assert torch.equal(slerp(z0, z1, 0.0), z0)
    assert torch.equal(slerp(z0, z1, 1.0), z1)
    a = torch.tensor([0.0, 1.0, 0.0])
    out = slerp(z0, z1, a)
    assert torch.equal(out[0], z0[0]) and torch.equal(out[1], z1[1]) and torch.equal(out[2], z0[2])


def test_slerp_constant_angular_speed_on_unit_vectors():
    u0 = torch.tensor([[1.0, 0.0, 0.0]])
    u1 = torch.tensor([[0.0, 1.0, 0.0]])
    for a in (0.25, 0.5, 0.75):
        out = slerp(u0, u1, a)[0]
        torch.testing.assert_close(out, torch.tensor([math.cos(a * math.pi / 2), math.sin(a * math.pi / 2), 0.0]))


def test_slerp_per_item_alpha_shapes():
    z0, z1 = _pair(1, b=4)
    a = torch.tensor([0.1, 0.4, 0.6, 0.9])
    out = slerp(z0, z1, a)
    for i in range(4):
        torch.testing.assert_close(out[i:i + 1], slerp(z0[i:i + 1], z1[i:i + 1], float(a[i])))
    torch.testing.assert_close(slerp(z0, z1, a.view(4, 1, 1, 1)), out)
    with pytest.raises(InputError, match="one value per item"):
        slerp(z0, z1, torch.rand(4, 4, 5, 5))
    with pytest.raises(InputError, match=r"\[0, 1\]"):
        slerp(z0, z1, 1.5)
    with pytest.raises(InputError, match="floating-point"):
        slerp(torch.ones(2, 3, dtype=torch.int64), torch.ones(2, 3, dtype=torch.int64), 0.5)


def test_slerp_numpy_in_numpy_out():
    z0, z1 = (z.numpy() for z in _pair(2))
    out = slerp(z0, z1, 0.3)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == z0.shape


@FAST
@given(seed=st.integers(0, 10_000), alpha=st.floats(0, 1), k=st.floats(0.01, 100))
def test_slerp_colinear_equals_lerp(seed, alpha, k):
    z0, _ = _pair(seed)
    z1 = z0 * k  # same direction, θ = 0
    torch.testing.assert_close(slerp(z0, z1, alpha), lerp(z0, z1, alpha), rtol=1e-5, atol=1e-6)


@FAST
@given(seed=st.integers(0, 10_000), alpha=st.floats(0, 1))
def test_slerp_antipodal_is_finite_deterministic_and_keeps_norm(seed, alpha):
    z0, _ = _pair(seed)
    z1 = -2 * z0
    out = slerp(z0, z1, alpha)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(_norms(out), (1 - alpha) * _norms(z0) + alpha * _norms(z1), rtol=1e-5, atol=0)
    assert torch.equal(out, slerp(z0, z1, alpha))
    if 0.05 < alpha < 0.95:  # passes off the line through the endpoints instead of through zero
        cos = torch.nn.functional.cosine_similarity(out.flatten(1).double(), z0.flatten(1).double())
        assert (cos.abs() < 1 - 1e-4).all()


@FAST
@given(seed=st.integers(0, 10_000), alpha=st.floats(0, 1), eps=st.sampled_from([1e-7, 1e-5, 1e-3, 1e-2]))
def test_slerp_near_antipodal_stays_finite_with_the_right_norm(seed, alpha, eps):
    z0, d = _pair(seed, b=2, shape=(256,))
    z1 = (-z0 + eps * d * _norms(z0)[:, None] / _norms(d)[:, None]).float()
    out = slerp(z0, z1, alpha)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(_norms(out), (1 - alpha) * _norms(z0) + alpha * _norms(z1), rtol=1e-5, atol=0)


def test_slerp_antipodal_path_is_continuous():
    z0 = torch.randn(1, 64, generator=torch.Generator().manual_seed(3))
    z1 = -z0
    alphas = torch.linspace(0, 1, 201)
    path = slerp(z0.expand(201, 64), z1.expand(201, 64), alphas)
    steps = (path[1:] - path[:-1]).norm(dim=1)
    assert steps.max() < 3 * steps.median()  # no jump at α = ½ or at the ends


def test_slerp_zero_vectors_do_not_nan():
    z = torch.zeros(2, 8)
    v = torch.randn(2, 8)
    for a in (0.0, 0.3, 1.0):
        assert torch.equal(slerp(z, z, a), z)
        torch.testing.assert_close(slerp(z, v, a), a * v)
        torch.testing.assert_close(slerp(v, z, a), (1 - a) * v)
    # one-element latents (a scalar per item): sign flips fall back to lerp
    out = slerp(torch.tensor([[1.0]]), torch.tensor([[-1.0]]), 0.5)
    assert torch.isfinite(out).all()


def test_norm_deficit_matches_cos_half_theta_for_equal_norms():
    g = torch.Generator().manual_seed(0)
    u0 = torch.nn.functional.normalize(torch.randn(64, 4 * 32 * 32, generator=g), dim=1)
    u1 = torch.nn.functional.normalize(torch.randn(64, 4 * 32 * 32, generator=g), dim=1)
    nd = norm_deficit(u0, u1)
    np.testing.assert_allclose(nd.lerp_ratio, nd.predicted, rtol=1e-9)
    np.testing.assert_allclose(nd.theta, math.pi / 2, atol=0.1)  # random high-D vectors are ~orthogonal
    # slerp has no deficit
    mid = slerp(u0, u1, 0.5)
    torch.testing.assert_close(mid.norm(dim=1), torch.ones(64))


# ----------------------------------------------------------------------------- keyframes

@FAST
@given(n=st.integers(1, 500), stride=st.integers(1, 9))
def test_keyframe_indices(n, stride):
    idx = keyframe_indices(n, stride)
    assert idx[0] == 0 and idx[-1] == n - 1
    assert np.all(np.diff(idx) >= 1) and np.all(np.diff(idx) <= stride)
    assert idx.size == math.ceil((n - 1) / stride) + 1 if n > 1 else idx.size == 1
    assert duty_cycle(idx, n) == idx.size / n


def test_keyframe_indices_tail_and_writeup_counts():
    assert keyframe_indices(10, 4).tolist() == [0, 4, 8, 9]
    assert keyframe_indices(640, 3).size == 214  # the write-up's 214 / 640
    assert keyframe_indices(640, 2).size == 321  # one more than the write-up's 320: the last frame is keyed
    with pytest.raises(InputError):
        keyframe_indices(0, 2)
    with pytest.raises(InputError):
        keyframe_indices(10, 0)


def _slow_expand(keys, idx, n, fn):
    out = torch.empty((n, *keys.shape[1:]), dtype=keys.dtype)
    for t in range(n):
        if t in idx:
            out[t] = keys[idx.index(t)]
            continue
        j = max(i for i, k in enumerate(idx) if k < t)
        a = (t - idx[j]) / (idx[j + 1] - idx[j])
        out[t] = fn(keys[j:j + 1], keys[j + 1:j + 2], a)[0]
    return out


@FAST
@given(n=st.integers(1, 60), stride=st.integers(1, 6), seed=st.integers(0, 1000),
       method=st.sampled_from(["slerp", "lerp"]))
def test_expand_matches_slow_loop(n, stride, seed, method):
    idx = keyframe_indices(n, stride)
    keys = torch.randn(idx.size, 4, 3, 3, generator=torch.Generator().manual_seed(seed))
    full = expand_keyframes(keys, stride, n, method=method)
    assert full.shape == (n, 4, 3, 3) and torch.isfinite(full).all()
    assert torch.equal(full[torch.as_tensor(idx)], keys)  # keyframes exact
    fn = slerp if method == "slerp" else lerp
    torch.testing.assert_close(full, _slow_expand(keys, idx.tolist(), n, fn), rtol=1e-5, atol=1e-5)


@FAST
@given(n=st.integers(2, 80), seed=st.integers(0, 1000))
def test_expand_with_irregular_indices(n, seed):
    rng = np.random.default_rng(seed)
    inner = np.sort(rng.choice(np.arange(1, n - 1), size=rng.integers(0, max(1, n - 2)), replace=False)) \
        if n > 2 else np.array([], dtype=np.int64)
    idx = np.concatenate([[0], inner, [n - 1]]).astype(np.int64)
    keys = torch.randn(idx.size, 8, generator=torch.Generator().manual_seed(seed))
    full = expand_keyframes(keys, idx, n)
    torch.testing.assert_close(full, _slow_expand(keys, idx.tolist(), n, slerp), rtol=1e-5, atol=1e-5)
    n0, n1 = keys.norm(dim=1), full.norm(dim=1)
    assert n1.min() >= n0.min() * (1 - 1e-5) and n1.max() <= n0.max() * (1 + 1e-5)


def test_expand_hold_and_errors():
    keys = torch.arange(4.0).view(4, 1) + 1
    full = expand_keyframes(keys, 3, 8)  # keys at 0, 3, 6, 7
    assert full.shape == (8, 1)
    held = expand_keyframes(keys, 3, 8, method="hold")
    assert held[:, 0].tolist() == [1, 1, 1, 2, 2, 2, 3, 4]
    with pytest.raises(InputError, match="3 key latents given but"):
        expand_keyframes(keys[:3], 3, 8)
    with pytest.raises(InputError, match="start at 0 and end"):
        expand_keyframes(keys, [0, 3, 6, 8], 10)
    with pytest.raises(InputError, match="method"):
        expand_keyframes(keys, 3, 8, method="cubic")


# ----------------------------------------------------------------------------- adaptive plans

SR, FPS, N = 16000, 25, 50
T = np.arange(int(SR * N / FPS)) / SR


def _check_plan(plan, n, max_gap):
    idx = plan.indices
    assert idx[0] == 0 and idx[-1] == n - 1
    assert np.all(np.diff(idx) >= 1) and np.all(np.diff(idx) <= max_gap)
    for arr in (plan.score, plan.allowed_gap, plan.stride_per_frame, plan.reason):
        assert len(arr) == n
    assert np.all(plan.stride_per_frame <= plan.allowed_gap)
    assert 0 <= plan.score.min() and plan.score.max() <= 1


@pytest.mark.parametrize("max_gap", [1, 2, 3, 5])
def test_adaptive_steady_tone_and_silence_take_the_widest_stride(max_gap):
    tone = 0.3 * np.sin(2 * np.pi * 220 * T) + 0.1 * np.sin(2 * np.pi * 440 * T)
    for audio, why in ((tone, "steady"), (np.zeros_like(T), "silence")):
        plan = adaptive_keyframes(audio, SR, FPS, N, max_gap=max_gap)
        _check_plan(plan, N, max_gap)
        assert (plan.reason == why).all()
        assert plan.indices.size == math.ceil((N - 1) / max_gap) + 1


def test_adaptive_click_train_gets_stride_one_around_each_click():
    clicks = np.zeros_like(T)
    times = np.arange(0.3, N / FPS, 0.4)
    for c in times:
        clicks[int(c * SR):int(c * SR) + 16] = 0.8
    plan = adaptive_keyframes(clicks, SR, FPS, N, max_gap=4)
    _check_plan(plan, N, 4)
    keys = set(plan.indices.tolist())
    for f in (times * FPS).astype(int):
        assert {f - 1, f, f + 1} <= keys, f
        assert plan.reason[f] == "onset"
    assert plan.stride_per_frame[2] == 4  # silence between clicks stays sparse
    assert plan.duty_cycle < 0.7


def test_adaptive_plosive_closure_and_burst():
    x = 0.3 * np.sin(2 * np.pi * 220 * T)
    x[int(0.80 * SR):int(0.88 * SR)] = 0.0  # 80 ms closure
    x[int(0.88 * SR):int(0.90 * SR)] += 0.5 * np.random.default_rng(1).standard_normal(int(0.02 * SR))
    plan = adaptive_keyframes(x, SR, FPS, N, max_gap=3)
    _check_plan(plan, N, 3)
    burst = int(0.88 * FPS)
    assert "plosive" in set(plan.reason[burst - 1:burst + 2])
    assert {burst - 1, burst, burst + 1} <= set(plan.indices.tolist())
    assert plan.stride_per_frame[5] == 3 and plan.stride_per_frame[40] == 3


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 1000), max_gap=st.integers(1, 6), n=st.integers(1, 40))
def test_adaptive_respects_max_gap_on_noise_bursts(seed, max_gap, n):
    rng = np.random.default_rng(seed)
    audio = rng.standard_normal(int(SR * n / FPS)) * (rng.random(int(SR * n / FPS)) < 0.01)
    plan = adaptive_keyframes(audio, SR, FPS, n, max_gap=max_gap)
    _check_plan(plan, n, max_gap)
    again = adaptive_keyframes(audio, SR, FPS, n, max_gap=max_gap)
    assert np.array_equal(plan.indices, again.indices)  # deterministic


def test_adaptive_speech_sits_between_dense_and_max_stride():
    from lab.data import DEFAULT_AUDIO, load_audio

    x, sr = load_audio(DEFAULT_AUDIO, sr=16000)
    n = int(len(x) / sr * FPS)
    plan = adaptive_keyframes(x, sr, FPS, n, max_gap=3)
    _check_plan(plan, n, 3)
    assert 1 / 3 < plan.duty_cycle < 0.9
    assert {"silence", "onset", "plosive", "steady"} <= set(plan.reason)
    assert plan.to_dict()["n_keyframes"] == plan.indices.size


def test_adaptive_input_errors():
    with pytest.raises(InputError, match="max_gap"):
        adaptive_keyframes(np.zeros(1000), SR, FPS, 5, max_gap=0)
    with pytest.raises(InputError, match="NaN"):
        adaptive_keyframes(np.full(1000, np.nan), SR, FPS, 5)
    with pytest.raises(InputError, match="positive"):
        adaptive_keyframes(np.zeros(1000), 0, FPS, 5)
    with pytest.raises(InputError, match="mono"):
        adaptive_keyframes(np.zeros((2, 2, 100)), SR, FPS, 5)
