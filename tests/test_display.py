"""What a reader sees: report tables keep their columns, a figure is shown once, labels read."""
from pathlib import Path

import matplotlib

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
