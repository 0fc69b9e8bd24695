"""``python -m torch_dataloader_utils profile``: read for N seconds with a consumer of a given step
time; the figures, the verdict, a plot when asked (and a clear message without matplotlib)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from _data import write_dataset
from test_cli import run


@pytest.fixture
def data(tmp_path: Path) -> str:
    write_dataset(tmp_path / "data", [400, 400], row_group_size=50)
    return str(tmp_path / "data")


def test_a_slow_step_is_the_bottleneck(data: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "profile", data, "--batch-size", "50", "--step-ms", "20",
                       "--seconds", "0.2")  # fmt: skip
    assert code == 0
    lines = out.splitlines()
    # 0.2 s of the epoch's 0.32 s of steps: stopped before its end
    assert re.fullmatch(
        rf"profile of {re.escape(data)} for 0\.[12] s: batch_size 50, num_workers 0, step 20 ms",
        lines[0],
    )
    assert lines[1].startswith("loop: ") and "rows/s" in lines[1]
    assert any(line.split()[:1] == ["main"] for line in lines)
    assert lines[-1].startswith("bottleneck: trainer: ")


def test_json_with_workers_and_a_mixture(
    tmp_path: Path, data: str, capsys: pytest.CaptureFixture[str]
) -> None:
    write_dataset(tmp_path / "other", [100], row_group_size=50, start=1000)
    code, out, _ = run(capsys, "profile", "--source", f"a={data}", "--source",
                       f"b={tmp_path / 'other'}", "--weight", "a=3", "--weight", "b=1",
                       "--num-workers", "2", "--prefetch-factor", "4", "--batch-size", "20",
                       "--seconds", "30", "--json")  # fmt: skip
    assert code == 0
    report = json.loads(out)
    assert report["settings"]["prefetch_factor"] == 4
    assert [p["process"] for p in report["processes"]] == ["main", "worker 0", "worker 1"]
    sources = {s["name"]: s for s in report["mixture"]}
    assert sources["a"]["share"] == 0.75
    assert sources["a"]["rows"] + sources["b"]["rows"] == report["since_start"]["rows"]
    assert report["bottleneck"] in ("storage", "decode", "transform", "transport", "trainer")


def test_plot(data: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "profile.png"
    code, out, _ = run(capsys, "profile", data, "--seconds", "0.6", "--step-ms", "5",
                       "--batch-size", "10", "--plot", str(png))  # fmt: skip
    assert code == 0 and out.splitlines()[-1] == f"plot: {png}"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_what_to_do(
    data: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    code, out, err = run(capsys, "profile", data, "--plot", str(tmp_path / "p.png"))
    assert (code, out) == (2, "")
    assert "--plot needs matplotlib, which is not installed: pip install matplotlib" in err
    assert not (tmp_path / "p.png").exists()


def test_bad_options_are_refused(data: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "profile", data, "--prefetch-factor", "2")
    assert code == 2 and "--prefetch-factor needs --num-workers >= 1" in err
    code, _, err = run(capsys, "profile", data, "--seconds", "0")
    assert code == 2 and "--seconds must be > 0" in err
