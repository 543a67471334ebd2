"""Three-stage pipeline: the schedule, results equal to the plain loop, errors, busy fraction."""
from types import SimpleNamespace

import pytest
import torch

from lab.serving import streams as sp
from lab.errors import InputError


def _stages():
    audio = lambda t: torch.full((4,), float(t))           # noqa: E731
    gen = lambda x: x * 2 + 1                               # noqa: E731
    post = lambda y: y.sum()[None]                          # noqa: E731
    return audio, gen, post


@pytest.mark.parametrize("run", [sp.run_sequential, sp.run_threaded, sp.run_streams])
def test_every_mode_delivers_the_same_chunks_in_order(run):
    got = {}
    rep = run(7, *_stages(), sink=lambda t, x: got.__setitem__(t, float(x[0])))
    assert rep.delivered == list(range(7))
    assert got == {t: 4 * (2 * t + 1) for t in range(7)}
    sp.check_order(rep.order, 7)


def test_streams_schedule_overlaps_three_chunks():
    rep = sp.run_streams(5, *_stages(), sink=lambda t, x: None)
    # step 2 issues gen for chunk 1, audio for chunk 2, post for chunk 0
    assert rep.order[:6] == [("audio", 0), ("gen", 0), ("audio", 1), ("gen", 1), ("audio", 2), ("post", 0)]
    assert "no CUDA" in rep.mode


def test_check_order_catches_a_bad_schedule():
    with pytest.raises(AssertionError, match="chunk 0"):
        sp.check_order([("gen", 0), ("audio", 0), ("post", 0)], 1)


def test_bad_input_and_sink_errors():
    with pytest.raises(InputError, match="n_chunks"):
        sp.run_streams(0, *_stages(), sink=lambda t, x: None)

    def sink(t, x):
        if t == 2:
            raise RuntimeError("encoder died")
    with pytest.raises(RuntimeError, match="encoder died"):
        sp.run_threaded(6, *_stages(), sink=sink)


def test_busy_fraction_is_the_union_of_gpu_intervals():
    cuda = torch.autograd.DeviceType.CUDA
    ev = lambda s, e, d=cuda: SimpleNamespace(device_type=d, time_range=SimpleNamespace(start=s, end=e))  # noqa: E731
    prof = SimpleNamespace(events=lambda: [ev(0, 10), ev(5, 20), ev(30, 40), ev(0, 100, torch.autograd.DeviceType.CPU)])
    b = sp.busy_fraction(prof)
    assert b["busy_fraction"] == pytest.approx(30 / 40)
    with pytest.raises(InputError, match="no GPU events"):
        sp.busy_fraction(SimpleNamespace(events=lambda: []))
