"""The command line, end to end: ``python -m torch_dataloader_utils plan | inspect | verify``.

The ``slow`` tests run the module in a subprocess, as users do, and parse what it prints; the
others call ``main()`` in-process for the many ways input can be bad (exit 2, one error line).
Checkpoints come from real loaders: 2 ranks x 2 workers, shuffled, rank ``r`` after ``3 + r``
batches of 24 rows.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _data import replace_parquet, rows_table, write_dataset
from _s3server import FAKE_KEY, FAKE_SECRET, S3Env, s3_fixture, s3_server_fixture  # noqa: F401
from conftest import ROWS_PER_FILE

from torch_dataloader_utils import StructuredDataset
from torch_dataloader_utils.cli import main

ROWS = ROWS_PER_FILE
TOTAL = sum(ROWS)
SPLIT = 2048  # about two row groups of 16 rows per split: 16 splits
CASE: dict[str, Any] = {"batch_size": 24, "split_bytes": SPLIT, "shuffle": True, "shuffle_seed": 5}


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m torch_dataloader_utils *args`` in a subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "torch_dataloader_utils", *args],
        capture_output=True, text=True, timeout=120, cwd=cwd,
    )  # fmt: skip


def states_after(path: str, world_size: int = 2, **case: Any) -> list[dict[str, Any]]:
    """Every rank's state after ``3 + rank`` batches of a 2-worker loader."""
    states = []
    for rank in range(world_size):
        loader, dataset = StructuredDataset.create_dataloader(
            path, num_workers=2, rank=rank, world_size=world_size, **{**CASE, **case}
        )
        it = iter(loader)
        for _ in range(3 + rank):
            next(it)
        states.append(dataset.state_dict())
        del it
    return states


@pytest.fixture(scope="module")
def data(parquet_dir: Path) -> Path:
    """The suite's 3 files of 230/170/300 rows in row groups of 16 (read only)."""
    return parquet_dir


@pytest.fixture(scope="module")
def saved(data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``rank0.json``: one state; ``all.json``: the list; ``ckpt.pt``: the list under a key."""
    out = tmp_path_factory.mktemp("cli-ckpt")
    states = states_after(str(data))
    (out / "rank0.json").write_text(json.dumps(states[0]))
    (out / "all.json").write_text(json.dumps(states))
    model = {"w": torch.zeros(3)}
    torch.save({"model": model, "step": 7, "train": {"data": states}}, out / "ckpt.pt")
    return {name: out / name for name in ("rank0.json", "all.json", "ckpt.pt")}


# ----------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_plan_json_deals_every_row(data: Path) -> None:
    done = cli("plan", str(data), "--split-bytes", "2KiB", "--world-size", "3",
               "--num-workers", "2", "--shuffle", "--seed", "5", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert [f["rows"] for f in plan["files"]] == list(ROWS)
    assert plan["totals"]["splits"] == sum(f["splits"] for f in plan["files"]) == 16
    streams = plan["streams"]
    assert [(s["rank"], s["worker"]) for s in streams] == [(r, w) for r in range(3) for w in (0, 1)]
    assert sum(s["rows"] for s in streams) == plan["rows_dealt"] == TOTAL - plan["left_out"]
    assert 0 <= plan["left_out"] < 3  # even_batches (on for 3 ranks) leaves < world_size out
    per_rank = [sum(s["rows"] for s in streams if s["rank"] == r) for r in range(3)]
    assert per_rank == [TOTAL // 3] * 3
    dealt_bytes = plan["totals"]["bytes"] * plan["rows_dealt"] / TOTAL  # bytes are per row
    assert sum(s["bytes"] for s in streams) == pytest.approx(dealt_bytes, rel=0.01)


@pytest.mark.slow
def test_inspect_finds_the_state_under_a_key(saved: dict[str, Path]) -> None:
    done = cli("inspect", str(saved["ckpt.pt"]))
    assert done.returncode == 0, done.stderr
    assert "key 'train.data': 2 rank state(s), epoch 0" in done.stdout
    assert "shuffle_seed=5" in done.stdout and "num_workers=2" in done.stdout
    assert "rank 0: " in done.stdout and "rank 1: " in done.stdout


@pytest.mark.slow
def test_inspect_with_data_reports_rows_per_worker(saved: dict[str, Path], data: Path) -> None:
    done = cli("inspect", str(saved["ckpt.pt"]), "--data", str(data), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["key"] == "train.data"
    for rank in report["ranks"]:
        streams = rank["streams"]
        assert [s["worker"] for s in streams] == [0, 1]
        assert sum(s["rows"] for s in streams) == 24 * (3 + rank["rank"])
        assert sum(s["share"] for s in streams) == TOTAL // 2


@pytest.mark.slow
def test_verify_ok(saved: dict[str, Path], data: Path) -> None:
    done = cli("verify", str(saved["ckpt.pt"]), str(data))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith(f"OK: {saved['ckpt.pt']} (key 'train.data') resumes cleanly")
    assert f"{24 * 7} of {TOTAL} rows delivered" in done.stdout


@pytest.mark.slow
def test_verify_after_a_file_changed(data: Path, tmp_path: Path) -> None:
    copy = tmp_path / "data"
    shutil.copytree(data, copy)
    ckpt = tmp_path / "rank0.json"
    ckpt.write_text(json.dumps(states_after(str(copy))[0]))
    replace_parquet(copy / "part-00001.parquet", rows_table(230, 170), row_group_size=10)
    done = cli("verify", str(ckpt), str(copy))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Likely cause: files changed" in done.stdout
    assert "part-00001.parquet" in done.stdout


@pytest.mark.slow
def test_verify_with_another_seed(saved: dict[str, Path], data: Path) -> None:
    done = cli("verify", str(saved["all.json"]), str(data), "--seed", "6")
    assert done.returncode == 1
    assert "Likely cause: shuffle_seed changed: checkpoint=5, current=6" in done.stdout


@pytest.mark.slow
def test_bad_input_is_an_error_line(tmp_path: Path, data: Path) -> None:
    done = cli("verify", str(tmp_path / "missing.pt"), str(data))
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip() == (
        f"torch_dataloader_utils verify: error: checkpoint {tmp_path / 'missing.pt'}: no such file"
    )


@pytest.mark.slow
@pytest.mark.s3
def test_verify_against_s3(s3: S3Env, tmp_path: Path) -> None:
    for path in write_dataset(tmp_path / "src", ROWS, row_group_size=16):
        s3.put_bytes(f"data/{Path(path).name}", Path(path).read_bytes())
    url = s3.url("data")
    states = states_after(url, world_size=1, storage_options=s3.options)
    ckpt = tmp_path / "state.json"
    ckpt.write_text(json.dumps(states[0]))
    options = [f"endpoint_url={s3.endpoint}", f"key={FAKE_KEY}", f"secret={FAKE_SECRET}"]
    flags = [arg for option in options for arg in ("--storage-option", option)]
    done = cli("verify", str(ckpt), url, *flags)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{url}: rank 0, epoch 0, 3 files, 16 splits; 72 of {TOTAL} rows" in done.stdout
    s3.put_table("data/part-00002.parquet", rows_table(0, 10))  # same key, new ETag
    done = cli("verify", str(ckpt), url, *flags)
    assert done.returncode == 1 and "Likely cause: files changed" in done.stdout
    assert FAKE_SECRET not in done.stdout + done.stderr


# ----------------------------------------------------------------------------- in-process


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_text(capsys: pytest.CaptureFixture[str], data: Path) -> None:
    code, out, _ = run(capsys, "plan", str(data), "-v", "--split-bytes", "2KiB", "--world-size=2")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "3 files, 16 splits, 700 rows, 26.0 KiB stored (parquet, split_bytes 2048)"
    assert "700 rows dealt to 2 rank(s) x 1 worker stream(s) (shuffle off" in out
    assert lines[-1] == "left out by even_batches: 0 rows"


def test_plan_rows_are_what_each_rank_reads(capsys: pytest.CaptureFixture[str], data: Path) -> None:
    code, out, _ = run(capsys, "plan", str(data), "--split-bytes", "2048", "--world-size", "3",
                       "--no-even-batches", "--shuffle", "--json")  # fmt: skip
    assert code == 0
    planned = [s["rows"] for s in json.loads(out)["streams"]]
    read = [
        sum(len(b["id"]) for b in StructuredDataset(str(data), split_bytes=SPLIT, shuffle=True,
                                                    rank=r, world_size=3, even_batches=False))
        for r in range(3)
    ]  # fmt: skip
    assert planned == read and sum(read) == TOTAL


def test_inspect_a_json_state(capsys: pytest.CaptureFixture[str], saved: dict[str, Path]) -> None:
    code, out, _ = run(capsys, "inspect", str(saved["rank0.json"]))
    assert code == 0
    assert out.splitlines()[0] == f"checkpoint {saved['rank0.json']}: 1 rank state(s), epoch 0"
    assert "files: 3, splits: 16" in out and "rank 0: " in out and "cursor" in out


def test_inspect_json_counts_delivered_rows(
    capsys: pytest.CaptureFixture[str], saved: dict[str, Path]
) -> None:
    code, out, _ = run(capsys, "inspect", str(saved["all.json"]), "--json")
    report = json.loads(out)
    assert code == 0 and report["key"] is None
    for rank in report["ranks"]:  # rows handed out per worker stream, and of its share
        assert sum(s["rows"] for s in rank["streams"]) == 24 * (3 + rank["rank"])
        assert all(s["rows"] < s["share"] and s["split"] for s in rank["streams"])


def test_verify_elastic(
    capsys: pytest.CaptureFixture[str], saved: dict[str, Path], data: Path
) -> None:
    args = ("verify", str(saved["all.json"]), str(data), "--world-size", "3", "--num-workers", "0")
    code, out, _ = run(capsys, *args)
    assert code == 1 and "Likely cause: world_size changed: checkpoint=2, current=3" in out
    assert "verify --elastic" in out
    code, out, _ = run(capsys, *args, "--elastic")
    assert code == 0, out
    left = TOTAL - 24 * 7
    assert f"{left - left % 3} rows remain for world_size 3 x 1 worker stream(s)" in out


def test_verify_a_list_needs_every_rank(
    capsys: pytest.CaptureFixture[str], saved: dict[str, Path], data: Path, tmp_path: Path
) -> None:
    states = json.loads(saved["all.json"].read_text())
    (tmp_path / "twice.json").write_text(json.dumps([states[0], states[0]]))
    code, out, _ = run(capsys, "verify", str(tmp_path / "twice.json"), str(data))
    assert code == 1 and "missing [1], duplicated [0]" in out


def _corrupt(state: dict[str, Any]) -> dict[str, Any]:
    return {**state, "generations": [[1, 2, False, "not base64!", ""]]}


@pytest.mark.parametrize(
    ("content", "extra", "message"),
    [
        (b"\x00garbage", (), "is neither JSON nor a file torch.load(weights_only=True) reads"),
        (b"{not json", (), "is not valid JSON"),
        (b'{"model": {"w": 1}}', (), "no dataset state found in a dict with keys ['model']"),
        (b'{"version": 1, "_num_workers": 0}', (), "this state is version 1"),
        (None, ("--key", "train.x"), "key 'train.x': train has no key 'x'; it has ['data']"),
        (None, ("--key", "model"), "key 'model' holds a dict with keys ['w'], not a dataset"),
        ("corrupt", (), "state key 'generations[0].positions' is corrupted"),
        ("ok", ("--storage-option", "secret"), "takes KEY=VALUE, got one without '='"),
    ],
)
def test_bad_input_exits_2(
    capsys: pytest.CaptureFixture[str],
    saved: dict[str, Path],
    tmp_path: Path,
    content: bytes | str | None,
    extra: tuple[str, ...],
    message: str,
) -> None:
    path = saved["ckpt.pt"]
    if isinstance(content, bytes):
        path = tmp_path / "ckpt"
        path.write_bytes(content)
    elif content is not None:
        state = json.loads(saved["rank0.json"].read_text())
        path = tmp_path / "state.json"
        path.write_text(json.dumps(_corrupt(state) if content == "corrupt" else state))
    code, out, err = run(capsys, "inspect", str(path), *extra)
    assert (code, out) == (2, "")
    assert err.startswith("torch_dataloader_utils inspect: error: ") and message in err, err


def test_bad_data_path_and_arguments(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "plan", str(tmp_path / "nowhere"))
    assert code == 2 and "error: no such file, directory or prefix" in err
    with pytest.raises(SystemExit) as info:
        main(["plan", str(tmp_path), "--split-bytes", "12X"])
    assert info.value.code == 2
    assert "expected bytes like 4096, 64KiB or 128MiB, got '12X'" in capsys.readouterr().err


def test_storage_options_and_sizes() -> None:
    from torch_dataloader_utils.cli.args import byte_size, storage_options

    assert [byte_size(t) for t in ("4096", "64KiB", "2k", "128MiB", "1 GB")] == [
        4096, 65536, 2048, 128 * 2**20, 2**30,
    ]  # fmt: skip
    options = storage_options(["anon=false", "key=1234", 'config_kwargs={"a": 1}', "x=y=z"])
    assert options == {"anon": False, "key": "1234", "config_kwargs": {"a": 1}, "x": "y=z"}


def test_inspect_with_data_in_process(
    capsys: pytest.CaptureFixture[str], saved: dict[str, Path], data: Path, tmp_path: Path
) -> None:
    code, out, _ = run(capsys, "inspect", str(saved["all.json"]), "--data", str(data))
    assert code == 0
    assert any(line.startswith("  worker 1: 24 of 175 rows (13.7 %), at part-0000")
               for line in out.splitlines())  # fmt: skip
    assert out.splitlines()[-1] == f"all ranks: {24 * 7} of {TOTAL} rows of their shares (24.0 %)"
    write_dataset(tmp_path / "other", (50,), row_group_size=10)
    code, out, _ = run(capsys, "inspect", str(saved["all.json"]), "--data", str(tmp_path / "other"))
    assert code == 1 and "MISMATCH with the files now: " in out and "files changed" in out


def test_verify_one_rank_in_process(
    capsys: pytest.CaptureFixture[str], saved: dict[str, Path], data: Path
) -> None:
    code, out, _ = run(capsys, "verify", str(saved["rank0.json"]), str(data))
    assert code == 0 and f"rank 0, epoch 0, 3 files, 16 splits; 72 of {TOTAL // 2} rows" in out


def test_states_under_several_keys(
    capsys: pytest.CaptureFixture[str], saved: dict[str, Path], tmp_path: Path
) -> None:
    states = json.loads(saved["all.json"].read_text())
    path = tmp_path / "two.json"
    path.write_text(json.dumps({"a": states, "b": {"c": [states[1], 3]}, "d": {"e": states[0]}}))
    code, _, err = run(capsys, "inspect", str(path))
    assert code == 2 and "dataset states found under several keys ['a', 'd.e']: choose" in err
    code, out, _ = run(capsys, "inspect", str(path), "--key", "b.c.0")
    assert code == 0 and "key 'b.c.0': 1 rank state(s)" in out and "rank 1: " in out
    for key, message in [("b.c.5", "b.c is a list of 2, not '5'"), ("b.c.1.x", "is a int")]:
        code, _, err = run(capsys, "inspect", str(path), "--key", key)
        assert code == 2 and message in err, err
    code, _, err = run(capsys, "inspect", str(tmp_path))
    assert code == 2 and f"checkpoint {tmp_path} cannot be read" in err


def test_inspect_an_elastic_state(
    capsys: pytest.CaptureFixture[str], saved: dict[str, Path], data: Path, tmp_path: Path
) -> None:
    loader, dataset = StructuredDataset.create_dataloader(str(data), **CASE)
    dataset.load_state_dict(json.loads(saved["all.json"].read_text()), elastic=True)
    next(iter(loader))
    (tmp_path / "elastic.json").write_text(json.dumps(dataset.state_dict()))
    code, out, _ = run(capsys, "inspect", str(tmp_path / "elastic.json"), "--data", str(data))
    assert code == 0 and "  after a deal to world_size 2 x num_workers 2 (elastic resume)" in out
    assert f"worker 0: 24 of {TOTAL - 24 * 7} rows" in out
