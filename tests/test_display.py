"""What a reader sees: report tables keep their columns, a figure is shown once, labels read."""
from pathlib import Path
from types import SimpleNamespace

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from lab import runner  # noqa: E402
from lab.results import Result  # noqa: E402


def _row_cells(line: str) -> int:
    """Columns of a markdown table row, not counting escaped `\\|`."""
    return line.replace("\\|", "").count("|") - 1


def test_report_tables_escape_pipes_and_name_the_commit(tmp_path: Path):
    out = tmp_path / "03_fp8"
    res = Result(name="03_fp8", params={}, headline={"mean |FP8 − FP16|": 0.5})
    res.compare(source="paper", claim="mean |FP8 − FP16| of the output", their_value=1.0, their_hardware="X",
                our_value=2.0, our_hardware="Y | Z", unit="", verdict="differs", reason="a\nb")
    res.save(out)
    entry = runner.Entry("03_fp8", "ok", 1.0, str(out), str(out / "x.ipynb"), device="cpu", headline=res.headline)
    rep = runner.report(tmp_path, [entry], {"quick": True})
    assert "Commit:" in rep.splitlines()[2]
    table, header = [], None
    for line in rep.splitlines():
        if line.startswith("|"):
            header = header if table else _row_cells(line)
            table.append(line)
        elif table:
            assert all(_row_cells(r) == header for r in table), table
            table, header = [], None
    assert all(_row_cells(r) == header for r in table), table
    assert "mean \\|FP8 − FP16\\| of the output" in rep


def test_serving_show_closes_the_figure_it_displays():
    from lab.experiments import serving

    fig, _ = plt.subplots()
    serving.show(serving.Section("t", [{"a": 1}], figure=fig))
    assert not plt.fignum_exists(fig.number)


def test_bold_title_never_spans_paragraphs():
    from lab.experiments import ditto

    md = ditto.table([{"a": 1}], None, "warp + decode\n\n1.0 GFLOP per frame\n\n- `x`: y").data
    for para in md.split("\n\n"):
        assert para.count("**") % 2 == 0, para
    assert md.startswith("**warp + decode**\n\n1.0 GFLOP")


def test_latentsync_finish_renders_the_headline_as_a_table(tmp_path: Path):
    import time
    from types import SimpleNamespace

    from lab.experiments import latentsync

    ctx = SimpleNamespace(res=Result(name="07_latentsync", params={},
                                     tables={"modes": [{"mode": "exact", "s_per_output_s": 2.5}]}),
                          t0=time.perf_counter(), folder=tmp_path)
    md = latentsync.finish(ctx).data
    assert "| headline | value |" in md
    assert "exact: s per output second" in md and "{" not in md
    assert (tmp_path / "results.json").exists()


def test_cpu_ceilings_keep_significant_figures():
    from lab.experiments import environment

    assert environment._sig(0.04237) == 0.0424 and environment._sig(987.65) == 988.0


def _titles(fig) -> list[str]:
    return [ax.get_title() for ax in fig.axes]


def test_identical_frames_diff_map_keeps_a_readable_scale():
    import numpy as np

    from lab import widgets

    x = np.random.default_rng(0).integers(0, 256, (1, 32, 32, 3), dtype=np.uint8)
    long = "stride 3 · " + "x" * 90
    fig = widgets.comparison_figure({"dense": x, long: x.copy()}, "dense", long, 0)
    diff = next(ax for ax in fig.axes if ax.images and ax.images[0].get_array().ndim == 2)
    assert diff.images[0].get_clim()[1] >= 1 / 255 - 1e-12
    assert "identical" in diff.get_title()
    fig.canvas.draw()
    bar = fig.axes[-1]
    assert bar.yaxis.get_offset_text().get_text() == ""        # no "1e-6" over the title
    assert all(len(line) <= 32 for t in _titles(fig) for line in t.split("\n"))   # long names wrapped
    plt.close(fig)


def test_worst_frames_diff_map_floor():
    import numpy as np

    from lab import plots

    x = np.random.default_rng(0).integers(0, 256, (2, 16, 16, 3), dtype=np.uint8)
    fig = plots.worst_frames_figure({"dense": x, "stride 2": x.copy()}, "dense")
    clims = [ax.images[0].get_clim()[1] for ax in fig.axes if ax.images and ax.images[0].get_array().ndim == 2]
    assert clims and min(clims) >= 1.0
    plt.close(fig)


def test_table_markdown_escapes_pipes():
    from lab import plots

    md = plots.table_markdown([{"claim": "mean |A − B|", "v": 1}])
    assert all(_row_cells(line) == 2 for line in md.splitlines())


def test_scrubber_controls_say_frame_and_mark_only_the_strided_side():
    import numpy as np
    import pytest

    pytest.importorskip("ipywidgets")
    from lab import widgets

    x = np.random.default_rng(0).integers(0, 256, (3, 16, 16, 3), dtype=np.uint8)
    view = widgets.decoder_comparator({"a": x, "b": x}, interactive=True, index_name="frame")
    assert view.controls.children[0].children[0].description == "frame"
    seen = []
    orig = widgets.comparison_figure
    widgets.comparison_figure = lambda *a, **k: seen.append(orig(*a, **k)) or seen[-1]
    try:
        s = widgets.stride_scrubber({"dense": x, "stride 2": x}, "dense", {"stride 2": np.array([0, 2])},
                                    interactive=True)
        s.redraw()
    finally:
        widgets.comparison_figure = orig
    titles = _titles(seen[-1])
    assert titles[0] == "#1: dense" and "interpolated" in titles[1]


def test_variants_not_run_are_listed_with_the_whole_reason():
    from lab.experiments import decoders

    why = "quick mode on CPU: torch.compile takes minutes here (Inductor's C++ codegen) for a smoke test"
    rows = [dict(decoder=k, variant="compile", status="skipped", reason=why) for k in ("sd-vae", "taesd")]
    rows.append(dict(decoder="taesd", variant="eager", status="ok", reason=""))
    text = decoders.not_run_text(rows)
    assert text.count("`compile`") == 1 and "(sd-vae, taesd)" in text and why in text and "eager" not in text
    assert decoders.not_run_text(rows[-1:]) == "Every variant ran."


# ----------------------------------------------------------------------------- plots where a plot reads better

def test_per_layer_errors_show_the_worst_layers_named_and_sorted():
    """179 layers in execution order were unlabelled bars: the figure draws the worst 20, largest first, each named."""
    from lab import plots

    rows = [{"name": f"decoder.up.{i}.conv", "path": "gemm", "out_rel_err": 0.01 + (i * 37 % 179) / 1e4,
             "weight_rel_err": 0.02} for i in range(179)]
    fig = plots.layer_errors({"unet": rows})
    ax = fig.axes[0]
    widths = [b.get_width() for b in ax.patches if isinstance(b, matplotlib.patches.Rectangle) and b.get_height() > 0.5]
    assert len(widths) == 20 and widths == sorted(widths, reverse=True)
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert len(labels) == 20 and all(t.startswith("decoder.up.") for t in labels)
    assert "20 worst of 179" in ax.get_title(loc="left")
    plt.close(fig)


def test_backend_speed_and_psnr_are_a_table_not_a_scatter_on_the_cap():
    from lab.experiments import backends as ex
    from lab.experiments.common import Run

    rows = [{"model": "sd-vae", "batch": 2, "backend": b, "speedup": s, "psnr_vs_eager": p, "status": "ok", "fps": 1.0}
            for b, s, p in (("eager", 1.0, float("inf")), ("compile", 1.5, float("inf")), ("onnx", 2.5, 130.6),
                            ("fp16", 3.0, 48.2))]
    res = Result(name="04_compile_backends", params={}, tables={"backends": rows})
    run = Run("04_compile_backends", {"precision": "fp32", "models": ["sd-vae"], "batches": [2], "quick": False,
                                   "backends": ["eager", "compile", "onnx", "fp16"]},
              torch.device("cpu"), Path("unused"), res, "cpu")
    md = ex.quality_table(run).data
    assert "| sd-vae b2 | fp16 | 3 | 48.2 |" in md and md.count("≥ 120 (same output)") == 2 and not res.figures
    assert md.index("| fp16") < md.index("| onnx") < md.index("| compile")


def test_wide_tables_are_narrow_with_their_figure():
    """06's waterfall and 07's modes: a narrow table beside the figure; the Result keeps every column."""
    from lab.experiments import ditto, latentsync

    assert len(ditto.COLUMNS["waterfall"]) <= 9
    long = "compile+cudagraph, attention kernels, fused_qkv, fused_norms, null_audio, shared_prefix"
    rows = [{"mode": "exact20 eager", "runner": "eager", "s_per_output_s": 3.8, "latent_cosine": 1.0, "wall_s": 1.0},
            {"mode": "exact20 fast", "runner": long, "s_per_output_s": 3.9, "latent_cosine": 0.99999, "wall_s": 1.0},
            {"mode": "dpm8 fast", "runner": long, "s_per_output_s": 1.7, "latent_cosine": 0.98, "wall_s": 1.0}]
    ctx = SimpleNamespace(job=SimpleNamespace(n_out=8), suffix=" · cpu")
    md = latentsync.mode_view(ctx, rows).data
    table = [ln for ln in md.splitlines() if ln.startswith("|")]
    assert md.count(long) == 1 and "A = eager" in md and f"B = {long}" in md
    assert all(len(ln) < 100 for ln in table) and _row_cells(table[0]) <= 9 and "| dpm8 fast | B |" in md
    assert "**modes over 8 frames · cpu**" in md and "**" not in md.split("\n\n", 1)[1]
