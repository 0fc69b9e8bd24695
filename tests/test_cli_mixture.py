"""The command line on a mixture's checkpoint: ``inspect`` and ``verify [--source NAME=PATH]``.

Checkpoints come from real loaders: sources ``web`` (2 files, 200 rows) and ``code`` (one file
of 12 rows, so each stream's share of 3 rows wraps into later source epochs), weights 3:1, 2
ranks x 2 workers, shuffled, rank ``r`` after ``3 + r`` batches of 8 rows. What the report
says of each source is checked against the rows the loader delivered (its ``source`` column).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _data import replace_parquet, rows_table, write_dataset, write_token_documents

from torch_dataloader_utils import StructuredDataset, TokenPacking
from torch_dataloader_utils.cli import main
from torch_dataloader_utils.mixing.state import expanded

NAMES = ("web", "code")
ROWS = {"web": 200, "code": 12}
WEIGHTS = {"web": 3, "code": 1}
CASE: dict[str, Any] = {"weights": WEIGHTS, "batch_size": 8, "shuffle": True, "shuffle_seed": 5,
                        "split_bytes": 2048, "num_workers": 2}  # fmt: skip
STREAMS = 4  # 2 ranks x 2 workers


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def write_sources(root: Path) -> dict[str, str]:
    """``web``: 2 files of ids 0-199 in ``root/web``; ``code``: ids 1000-1011 in one file."""
    write_dataset(root / "web", (120, 80), row_group_size=16)
    write_dataset(root / "code", (ROWS["code"],), row_group_size=4, start=1000)
    return {"web": str(root / "web"), "code": str(root / "code")}


def run_ranks(paths: dict[str, str]) -> tuple[list[dict[str, Any]], list[list[np.ndarray]]]:
    """Every rank's state after ``3 + rank`` batches, and the source number of each row its
    workers delivered (batches alternate between the 2 workers from worker 0)."""
    states, delivered = [], []
    for rank in range(2):
        loader, dataset = StructuredDataset.create_dataloader(
            paths, rank=rank, world_size=2, **CASE
        )
        it = iter(loader)
        batches = [next(it)["source"].numpy() for _ in range(3 + rank)]
        states.append(dataset.state_dict())
        it.close()
        delivered.append([np.concatenate(batches[w::2]) for w in range(2)])
    return states, delivered


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("cli-mixture")
    paths = write_sources(root)
    states, delivered = run_ranks(paths)
    (root / "all.json").write_text(json.dumps(states))
    torch.save({"model": {"w": torch.zeros(2)}, "data": states}, root / "ckpt.pt")
    return {"root": root, "paths": paths, "states": states, "delivered": delivered}


# ----------------------------------------------------------------------------- inspect


def test_inspect_reports_where_each_source_stands(
    capsys: pytest.CaptureFixture[str], mixed: dict[str, Any]
) -> None:
    code, out, _ = run(capsys, "inspect", str(mixed["root"] / "ckpt.pt"), "--json")
    assert code == 0
    report = json.loads(out)
    assert (report["key"], report["mixture"], report["epoch"]) == ("data", True, 0)
    assert report["settings"] == {
        "weights": WEIGHTS, "epoch_size": sum(ROWS.values()), "schedule_block": 0,
        "shuffle_seed": 5, "policies": {}, "shuffle": True, "even_batches": True,
        "world_size": 2, "num_workers": 2,
    }  # fmt: skip
    assert [r["positions"] for r in report["ranks"]] == [[16, 8], [16, 16]]
    assert [s["name"] for s in report["sources"]] == list(NAMES)
    for number, source in enumerate(report["sources"]):
        name = source["name"]
        assert source["weight"] == WEIGHTS[name]
        assert source["files"]["count"] == (2 if name == "web" else 1)
        assert source["files"]["root"] == mixed["paths"][name]
        share = ROWS[name] // STREAMS
        places = [(s["rank"], s["worker"], s["source_epoch"], s["rows"]) for s in source["streams"]]
        read = {
            (r, w): int((mixed["delivered"][r][w] == number).sum()) for r in (0, 1) for w in (0, 1)
        }
        assert places == [(r, w, n // share, n % share) for (r, w), n in read.items()]
        state = {
            (s["_rank"], w): expanded(s)["sources"][name] for s in mixed["states"] for w in (0, 1)
        }
        assert places == [
            (r, w, sub["epochs"][w], sub["streams"][w][0]) for (r, w), sub in state.items()
        ]
    assert any(s["source_epoch"] > 0 for s in report["sources"][1]["streams"])  # code wraps


def test_inspect_text_of_a_mixture(
    capsys: pytest.CaptureFixture[str], mixed: dict[str, Any]
) -> None:
    path = mixed["root"] / "all.json"
    code, out, _ = run(capsys, "inspect", str(path))
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == f"checkpoint {path}: mixture of 2 sources, 2 rank state(s), epoch 0"
    assert (
        lines[2] == "rank 0: positions [16, 8] of the epoch handed out per worker stream, cursor 1"
    )
    assert (
        f"source code: weight 1, 1 file(s) in {mixed['paths']['code']} (part-00000.parquet)" in out
    )
    assert lines[-1] == "all ranks given: 56 positions of the epoch's 212 handed out (26.4 %)"
    code, _, err = run(capsys, "inspect", str(path), "--data", mixed["paths"]["web"])
    assert code == 2 and "check a mixture's against its files with: verify CHECKPOINT" in err


# ----------------------------------------------------------------------------- verify


@pytest.mark.slow
def test_verify_a_mixture_end_to_end(mixed: dict[str, Any]) -> None:
    """``python -m torch_dataloader_utils verify`` without --source: the recorded paths."""
    path = mixed["root"] / "ckpt.pt"
    done = subprocess.run(
        [sys.executable, "-m", "torch_dataloader_utils", "verify", str(path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    web, code = mixed["paths"]["web"], mixed["paths"]["code"]
    assert done.stdout == (
        f"OK: {path} (key 'data') resumes cleanly against web={web} "
        f"code={code}/part-00000.parquet: 2 rank states, epoch 0, mixture of 2 sources; 56 of "
        f"the epoch's 212 positions handed out; read a batch from each of 4 worker stream(s)\n"
    )


def test_verify_names_the_source_and_file_that_changed(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    paths = write_sources(tmp_path)
    states, _ = run_ranks(paths)
    (tmp_path / "all.json").write_text(json.dumps(states))
    replace_parquet(tmp_path / "code" / "part-00000.parquet", rows_table(1000, 12), 3)
    code, out, _ = run(capsys, "verify", str(tmp_path / "all.json"))
    assert code == 1
    assert out.startswith(f"MISMATCH: {tmp_path / 'all.json'} does not resume against web=")
    assert "source 'code': checkpoint does not match the current files: stored " in out
    changed = f"checkpoint={tmp_path}/code/part-00000.parquet@"
    assert f"Likely cause: files changed (content changed (size or footer)): {changed}" in out


def test_verify_with_a_source_moved(
    capsys: pytest.CaptureFixture[str], mixed: dict[str, Any], tmp_path: Path
) -> None:
    """A state whose files moved: refused where they were, verified with ``--source``."""
    paths = write_sources(tmp_path / "old")
    states, _ = run_ranks(paths)
    (tmp_path / "rank1.json").write_text(json.dumps(states[1]))
    shutil.move(tmp_path / "old" / "web", tmp_path / "web-copy")
    code, _, err = run(capsys, "verify", str(tmp_path / "rank1.json"))
    assert code == 2 and f"no such file, directory or prefix: {paths['web']}" in err, err
    moved = f"web={tmp_path / 'web-copy'}"
    code, out, _ = run(capsys, "verify", str(tmp_path / "rank1.json"), "--source", moved)
    assert code == 0, out
    assert (
        f"resumes cleanly against {moved} code={paths['code']}/part-00000.parquet: rank 1," in out
    )
    assert "32 of the epoch's 212 positions handed out; read a batch from each of 2 worker" in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--source", "web"), "--source takes NAME=PATH, got 'web'"),
        (("--source", "=x"), "--source takes NAME=PATH, got '=x'"),
        (
            ("--source", "math=x"),
            "--source names ['math'], which the checkpoint's mixture does "
            "not have: its sources are ['web', 'code']",
        ),
        (("--source", "web=a", "--source", "web=b"), "--source names 'web' twice"),
        (("somewhere",), "a mixture's files are given per source: --source NAME=PATH"),
    ],
)
def test_bad_sources_exit_2(
    capsys: pytest.CaptureFixture[str],
    mixed: dict[str, Any],
    extra: tuple[str, ...],
    message: str,
) -> None:
    code, out, err = run(capsys, "verify", str(mixed["root"] / "all.json"), *extra)
    assert (code, out) == (2, "")
    assert err.startswith("torch_dataloader_utils verify: error: ") and message in err, err


def test_verify_with_other_settings_or_world(
    capsys: pytest.CaptureFixture[str], mixed: dict[str, Any]
) -> None:
    path = str(mixed["root"] / "all.json")
    code, out, _ = run(capsys, "verify", path, "--num-workers", "1")
    assert code == 1 and "Likely cause: num_workers changed: checkpoint=2, current=1" in out
    assert "verify --elastic" in out
    code, out, _ = run(
        capsys, "verify", path, "--elastic", "--world-size", "1", "--num-workers", "0"
    )
    assert code == 0, out
    assert out.endswith(
        "elastic, 2 old rank state(s) of epoch 0 onto world_size 1 x 1 worker stream(s); rank 0 "
        "read a batch from each of 1 worker stream(s)\n"
    )
    code, _, err = run(capsys, "verify", path, mixed["paths"]["web"], "--source", "web=x")
    assert code == 2 and "a mixture's files are given per source" in err


def test_a_mixture_state_checked_before_use(
    capsys: pytest.CaptureFixture[str], mixed: dict[str, Any], tmp_path: Path
) -> None:
    state = json.loads(json.dumps(mixed["states"][0]))
    state["sources"]["code"]["epochs"] = [0]
    (tmp_path / "bad.json").write_text(json.dumps(state))
    for command in ("inspect", "verify"):
        code, _, err = run(capsys, command, str(tmp_path / "bad.json"))
        assert code == 2
        assert "state of source 'code': state key 'epochs' must be a source epoch >= 0 per " in err
        assert "per worker stream, got [0]" in err


# ----------------------------------------------------------------------------- packed


def test_a_packed_mixture_checkpoint(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    paths = {n: str(write_token_documents(tmp_path / n, docs=d, files=f))
             for n, d, f in (("a", 60, 2), ("b", 40, 1))}  # fmt: skip
    loader, dataset = StructuredDataset.create_dataloader(
        paths, weights={"a": 2, "b": 1}, batch_size=2, epoch_size=40, num_workers=2,
        packing=TokenPacking("tokens", seq_len=8), shuffle=True,
    )  # fmt: skip
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = dataset.state_dict()
    it.close()
    (tmp_path / "packed.json").write_text(json.dumps(state))
    code, out, _ = run(capsys, "inspect", str(tmp_path / "packed.json"), "--json")
    report = json.loads(out)
    assert code == 0 and report["settings"]["packing"] == ["tokens", None]
    for source in report["sources"]:
        sub = expanded(state)["sources"][source["name"]]
        assert [(s["source_epoch"], s["rows"], s["tokens"]) for s in source["streams"]] == [
            (sub["epochs"][w], sub["streams"][w][0], sub["streams"][w][1]) for w in (0, 1)
        ]
    assert [r["positions"] for r in report["ranks"]] == [[4, 2]]  # sequences handed out
    code, out, _ = run(capsys, "verify", str(tmp_path / "packed.json"))
    assert code == 0 and "read a batch from each of 2 worker stream(s)" in out, out
    write_token_documents(tmp_path / "b", docs=41, files=1)  # one document more
    code, out, _ = run(capsys, "verify", str(tmp_path / "packed.json"))
    assert code == 1 and "source 'b': checkpoint does not match the current files" in out


# ----------------------------------------------------------------------------- plan


def test_plan_json_of_a_mixture_has_its_documented_keys(
    capsys: pytest.CaptureFixture[str], mixed: dict[str, Any]
) -> None:
    args = ["plan", "--json", "--world-size", "2", "--num-workers", "2", "--step", "1"]
    for name in NAMES:
        args += [
            "--source",
            f"{name}={mixed['paths'][name]}",
            "--weight",
            f"{name}={WEIGHTS[name]}",
        ]
    code, out, _ = run(capsys, *args)
    report = json.loads(out)
    assert code == 0 and set(report) == {"settings", "sources", "streams", "step"}
    assert set(report["settings"]) == {"epoch", "epoch_size", "batch_size", "world_size",
                                       "num_workers", "shuffle", "period"}  # fmt: skip
    assert [(s["name"], s["rows"], s["weight"]) for s in report["sources"]] == [
        ("web", 200, 3), ("code", 12, 1)
    ]  # fmt: skip
    assert set(report["sources"][0]) == {"name", "files", "rows", "weight", "share",
                                         "rows_per_epoch", "source_epochs_per_epoch"}  # fmt: skip
    stream = report["streams"][1][0]
    assert set(stream) == {"rank", "worker", "positions", "rows", "wraps"}
    assert (stream["rank"], stream["worker"], sum(stream["rows"].values())) == (1, 0, 53)
    assert set(report["step"]) == {"rank", "worker", "batch_of_worker", "rows"}
    assert set(report["step"]["rows"][0]) == {"source", "source_epoch", "file", "row"}


def test_a_state_at_the_end_of_its_epoch_and_states_of_two_mixtures(
    capsys: pytest.CaptureFixture[str], mixed: dict[str, Any], tmp_path: Path
) -> None:
    loader, dataset = StructuredDataset.create_dataloader(
        mixed["paths"], weights=WEIGHTS, batch_size=64
    )
    assert sum(len(b["id"]) for b in loader) == sum(ROWS.values())
    (tmp_path / "end.json").write_text(json.dumps(dataset.state_dict()))
    code, out, _ = run(capsys, "verify", str(tmp_path / "end.json"))
    assert code == 0, out
    assert out.endswith(
        "212 of the epoch's 212 positions handed out; no batch left in the epoch (the next is "
        "epoch + 1: set_epoch)\n"
    )
    other = StructuredDataset({"web": mixed["paths"]["web"]}, weights={"web": 1}).state_dict()
    (tmp_path / "two.json").write_text(json.dumps([mixed["states"][0], other]))
    code, _, err = run(capsys, "inspect", str(tmp_path / "two.json"))
    assert code == 2 and "the states are of different mixtures (sources [('web',), ('web'," in err


def test_one_datasets_state_takes_path_not_source(
    capsys: pytest.CaptureFixture[str], mixed: dict[str, Any], tmp_path: Path
) -> None:
    (tmp_path / "one.json").write_text(
        json.dumps(StructuredDataset(mixed["paths"]["web"]).state_dict())
    )
    for extra in ((), ("--source", f"web={mixed['paths']['web']}")):
        code, _, err = run(capsys, "verify", str(tmp_path / "one.json"), *extra)
        assert code == 2 and "this state is one dataset's: give its files as PATH" in err, err
    code, out, _ = run(capsys, "verify", str(tmp_path / "one.json"), mixed["paths"]["web"])
    assert code == 0 and "rank 0, epoch 0, 2 files" in out, out


def test_inspect_says_how_the_mixture_changed(
    capsys: pytest.CaptureFixture[str], mixed: dict[str, Any], tmp_path: Path
) -> None:
    """``changed`` of a reweighted state and of an elastic resume's, as ``docs/cli.md`` says:
    a reweight at the end of an epoch keeps that epoch's length per stream (``lengths``), and
    is not reported as an elastic resume."""
    web = {"web": mixed["paths"]["web"]}
    kwargs = {"batch_size": 8, "num_workers": 2}
    loader, _ = StructuredDataset.create_dataloader(web, weights={"web": 1}, **kwargs)
    assert sum(len(b["id"]) for b in loader) == 200
    ended = json.loads(json.dumps(loader.state_dict()))
    loader, _ = StructuredDataset.create_dataloader(web, weights={"web": 1}, **kwargs)
    it = iter(loader)
    next(it)
    middle = json.loads(json.dumps(loader.state_dict()))
    it.close()
    states = {}
    for name, state in (("ended", ended), ("middle", middle)):
        loader, _ = StructuredDataset.create_dataloader(mixed["paths"], weights=WEIGHTS, **kwargs)
        loader.load_state_dict(state, reweight=True)  # code added
        states[name] = loader.state_dict()
    loader, _ = StructuredDataset.create_dataloader(web, weights={"web": 1}, batch_size=8)
    loader.load_state_dict([middle], elastic=True)  # 2 workers -> 0
    states["elastic"] = loader.state_dict()
    said = {}
    for name, state in states.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(state))
        code, out, _ = run(capsys, "inspect", str(tmp_path / f"{name}.json"), "--json")
        assert code == 0
        said[name] = json.loads(out)["ranks"][0]["changed"]
        code, out, _ = run(capsys, "inspect", str(tmp_path / f"{name}.json"))
        said[name + " text"] = out.splitlines()[3:5]
    assert said["ended"] == {"epoch": 0, "positions": [100, 100], "rows": {"web": [100, 100]},
                             "lengths": [100, 100]}  # fmt: skip
    assert said["ended text"] == [
        "  the mixture changed (reweight) at epoch 0 positions [100, 100]",
        "  epoch 0 runs to [100, 100] positions per worker stream after the change",
    ]
    assert said["middle"] == {"epoch": 0, "positions": [8, 0], "rows": {"web": [8, 0]},
                              "lengths": []}  # fmt: skip
    assert said["middle text"][0] == "  the mixture changed (reweight) at epoch 0 positions [8, 0]"
    assert said["middle text"][1].startswith("source web: ")  # no line on the epoch's end
    assert said["elastic"] == {"epoch": 0, "positions": [], "rows": {}, "lengths": [192]}
    assert said["elastic text"][0] == (
        "  epoch 0 dealt anew by an elastic resume: [192] positions per worker stream"
    )
