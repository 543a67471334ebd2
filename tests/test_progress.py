"""The kernel heartbeat: a cell that prints nothing for a while still says it is alive, and a talkative one is left
alone. Run as a real notebook through papermill (the heartbeat lives in the kernel)."""
import json

import nbformat
import papermill


def _run(tmp_path, cells):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    src, out = tmp_path / "hb.ipynb", tmp_path / "hb.out.ipynb"
    nbformat.write(nb, src)
    papermill.execute_notebook(str(src), str(out), kernel_name="python3", progress_bar=False)
    return ["".join("".join(o.get("text", "")) for o in c["outputs"]) for c in json.loads(out.read_text())["cells"]]


def test_a_silent_cell_gets_still_running_lines_and_a_busy_one_none(tmp_path):
    texts = _run(tmp_path, [
        "from lab import progress\nassert progress.heartbeat(1.0)",
        "import time\ntime.sleep(3.6)",                                         # silent: a line after each quiet second
        "import time\nfor i in range(8):\n    print(i, flush=True)\n    time.sleep(0.2)",  # talks every 0.2 s
        "print('quick')",
    ])
    assert texts[1].count("still running") >= 2 and "[" in texts[1] and " s] " in texts[1]
    assert "still running" not in texts[2] and "still running" not in texts[3]


def test_outside_a_kernel_it_does_nothing():
    from lab import progress

    assert progress.heartbeat() is False
