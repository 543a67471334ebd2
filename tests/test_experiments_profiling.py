"""lab.experiments.profiling (notebook 01): parameter checks, the quick/device profile, the clip,
the waterfall steps and the comparison rows built from what a run kept. No models are built here
(tests/test_pipeline.py runs the engine, the neural bench and the trace)."""
import numpy as np
import pytest
import soundfile as sf
import torch

from lab import params
from lab.errors import InputError
from lab.experiments import profiling as ex
from lab.experiments.common import notebook_path

DEFAULTS = params.notebook_defaults(notebook_path(ex.NAME))


def _check(**values):
    return params.check({"quick": False, **values}, DEFAULTS, ex.RULES, where=ex.NAME)   # the full profile unless asked


@pytest.fixture
def threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("bad, name", [
    (dict(batch_size=0), "batch_size"), (dict(batch_size=2.0), "batch_size"), (dict(n_frames=-5), "n_frames"),
    (dict(fps=0), "fps"), (dict(fps=1e999), "fps=inf: expected a frame rate from 0.5 to 120"), (dict(fps=1e6), "fps"),
    (dict(fps=0.001), "fps"), (dict(dtype="fp8"), "dtype"), (dict(decoder="vae"), "decoder"),
    (dict(resampler="sox"), "resampler"), (dict(mode="parallel"), "mode"), (dict(writer="gif"), "writer"),
    (dict(preset="turbo"), "preset"), (dict(compile="max"), "compile"), (dict(subpixel=1), "subpixel"),
    (dict(run_waterfall="yes"), "run_waterfall"), (dict(waterfall_frames=0), "waterfall_frames"),
    (dict(face_batches=[1, 0]), r"face_batches\[1\]"), (dict(face_batches=4), "face_batches"),
    (dict(audio_path="/no/such/speech.wav"), "audio_path"), (dict(avatar_path=3), "avatar_path"),
    (dict(allow_silence="no"), "allow_silence"), (dict(weights_unet=1), "weights_unet"),
    (dict(batchsize=4), "batchsize"),
])
def test_bad_parameters_are_refused_by_name(bad, name):
    with pytest.raises(InputError, match=name):
        _check(**bad)


def test_defaults_pass_and_allow_silence_is_a_parameter():
    p = _check()
    assert p["allow_silence"] is False and p["n_frames"] == 775 and p["face_batches"] == [1, 2, 4, 8, 16, 32]


def test_quick_profile_on_cpu_is_a_tiny_smoke_run():
    p = ex.profile(_check(quick=True, batch_size=16, compile="reduce-overhead"), torch.device("cpu"))
    assert (p["size"], p["frame_size"], p["crop"], p["n_frames"], p["batch_size"]) == ("tiny", (128, 192), 64, 16, 4)
    assert p["compile"] == "none" and p["face_batches"] == [1, 2] and p["threads"] == 1
    assert not p["waterfall_compile"] and p["waterfall_rows_frames"] == 8 and p["trace_frames"] == 8


@pytest.mark.parametrize("dev, compile_steps, n", [("cpu", False, 1024), ("cuda", True, 8192)])
def test_full_profile_keeps_the_knobs_and_sizes_by_device(dev, compile_steps, n):
    p = ex.profile(_check(batch_size=8, waterfall_frames=120), torch.device(dev))
    assert (p["size"], p["frame_size"], p["crop"], p["n_frames"], p["batch_size"]) == ("full", (1080, 1920), 256, 775, 8)
    assert p["waterfall_compile"] is compile_steps and p["ceiling_n"] == n and p["waterfall_rows_frames"] == 120
    assert p["threads"] is None and p["compile"] == "reduce-overhead"


def test_waterfall_steps_keep_the_baseline_without_compile():
    labels = [s[0] for s in ex.waterfall_steps(False)]
    assert labels[0].startswith("baseline") and ex.BATCH_ROW in labels and ex.QUALITY_TRADE == labels[-1]
    assert not any(s[1].get("runtime", "eager") != "eager" for s in ex.waterfall_steps(False))
    assert len(ex.waterfall_steps(True)) == len(labels) + 1


def _run(tmp_path, **kw):
    return ex.start({"device": "cpu", "quick": True, "out_dir": str(tmp_path / "run"), **kw})


def test_start_sets_one_thread_for_quick_cpu_and_records_it(tmp_path, threads):
    run = _run(tmp_path)
    assert torch.get_num_threads() == 1 and run.result.params["threads"] == 1
    assert run.result.name == ex.NAME and "tiny models" in ex.describe(run)


def test_clip_repeats_the_bundled_speech_and_config_carries_allow_silence(tmp_path, threads):
    run = _run(tmp_path, n_frames=30, allow_silence=True)
    clip = ex.load_clip(run)
    assert clip.n_frames == 16 and len(clip.audio) / clip.sr >= 16 / 30 and clip.frames is None
    cfg = ex.config(run, clip)
    assert cfg.allow_silence is True and cfg.size == "tiny" and cfg.frame_size == (128, 192)
    # the notebook's engine on a CPU: the exact preset's techniques less the async switch (mode), the decoder
    # rewrites (their flags off) and the work placed on a GPU; the writer's 1 MiB pipe
    assert cfg.techniques == ("channels_last", "pinned_copy", "async_encode", "sleep_wait", "zero_copy")
    assert cfg.runtime == "eager" and cfg.encode.pipe_buffer == 1 << 20 and cfg.encode.x264_preset == "ultrafast"
    gpu = ex.settings("cuda", "sequential", "ffmpeg", subpixel=True)["techniques"]
    assert gpu == ("channels_last", "pinned_copy", "gpu_blend", "yuv420p_pipe", "region_composite", "sleep_wait",
                   "zero_copy", "subpixel")


def test_clip_from_a_short_file_covers_only_its_frames(tmp_path, threads):
    wav = tmp_path / "short.wav"
    sf.write(wav, (0.1 * np.sin(np.arange(8000) / 5)).astype(np.float32), 16000)  # 0.5 s
    run = ex.start({"device": "cpu", "quick": False, "n_frames": 100, "audio_path": str(wav),
                    "out_dir": str(tmp_path / "run")})
    clip = ex.load_clip(run)
    assert clip.sr == 16000 and clip.n_frames == 15 and "15 frames" in str(clip)


def test_silent_file_is_refused_unless_allow_silence(tmp_path, threads):
    wav = tmp_path / "quiet.wav"
    sf.write(wav, np.zeros(16000, np.float32), 16000)
    run = ex.start({"device": "cpu", "quick": True, "audio_path": str(wav), "out_dir": str(tmp_path / "a")})
    with pytest.raises(InputError, match="quiet.wav.*allow_silence"):
        ex.load_clip(run)
    run = ex.start({"device": "cpu", "quick": True, "audio_path": str(wav), "allow_silence": True,
                    "out_dir": str(tmp_path / "b")})
    assert ex.load_clip(run).n_frames == 16 and ex.config(run, ex.load_clip(run)).allow_silence


def test_no_waterfall_leaves_no_table_and_says_so(tmp_path, threads):
    run = _run(tmp_path, run_waterfall=False)
    assert ex.measure_waterfall(run, None, None) == [] and ex.waterfall_figure(run, []) is None
    assert "waterfall" not in run.result.tables and "not measured" in ex.show(run, "waterfall").data


def test_no_memory_lengths_leave_no_table(tmp_path, threads):
    run = _run(tmp_path, memory_minutes=[])
    assert ex.measure_memory(run, None, None) == [] and "not measured" in ex.show(run, "memory_by_length").data


def _kept(run, hidden=0.95):
    res = run.result
    res.tables["resamplers"] = [
        {"backend": "librosa_kaiser_best", "available": True, "median_ms": 900.0},
        {"backend": "torchaudio_gpu", "available": True, "median_ms": 1.5},
        {"backend": "librosa_soxr", "available": True, "median_ms": 20.0},
        {"backend": "scipy_poly", "available": False, "median_ms": None}]
    res.tables["waterfall"] = [{"step": s[0], "vae_decode_s": 0.5, "wall_s": 1.0} for s in ex.WATERFALL]
    res.tables["sfd_batch"] = [{"batch": 1, "fps": 10.0}, {"batch": 8, "fps": 25.0}]
    res.metrics["neural"] = {"decoder_fps": 70.0}
    res.metrics["run"] = {"fps": 40.0, "hidden_fraction": hidden, "mode": "async",
                          "config": {"batch_size": 16, "dtype": "fp16", "decoder": "sd-vae", "encode": {"x264_preset": "ultrafast"}}}


def test_compare_reads_the_kept_results_and_replaces_its_rows(tmp_path, threads):
    run = _run(tmp_path)
    _kept(run)
    ex.compare(run)
    view = ex.compare(run)
    rows = {c.claim: c for c in run.result.comparisons}
    assert len(rows) == len(run.result.comparisons) == 7
    assert rows["librosa → torchaudio GPU resample speed-up (25.8 s, 24→16 kHz)"].our_value == 600.0
    assert rows["librosa → torchaudio GPU resample speed-up (25.8 s, 24→16 kHz)"].verdict == "reproduced"
    assert rows["VAE decode share of a sequential fp16 batch-16 run"].our_value == 50.0
    assert rows["batched SFD (batch 8 vs 1) speed-up"].our_value == 2.5
    assert rows["async pipeline hides blend+encode time"].verdict == "not comparable"  # quick: no verdict
    assert "RTX 5090" in view.data


def test_compare_gives_verdicts_only_on_a_full_gpu_run(tmp_path, threads):
    run = _run(tmp_path)
    _kept(run, hidden=0.5)
    run.p.update(quick=False)
    run.device = torch.device("cuda")
    ex.compare(run)
    rows = {c.claim: c.verdict for c in run.result.comparisons}
    assert rows["async pipeline hides blend+encode time"] == "differs"
    assert rows["end-to-end FPS, async pipeline, 775 frames"] == "differs"


def test_compare_without_measurements_has_no_rows(tmp_path, threads):
    run = _run(tmp_path)
    ex.compare(run)
    assert run.result.comparisons == []
