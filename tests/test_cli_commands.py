"""The other commands: `data describe`, `data partition`, `report`, `demo`."""

from __future__ import annotations

import csv
import json

import yaml

from feddomain.cli import main


def test_describe_pacs_prints_counts_and_the_official_lists_two_flaws(shared_data, capsys):
    # The images are complete, but the official art_painting crossval list has two flawed lines
    # (a 0 label in a 1-based list, a repeated file): describe lists them, so it exits with 1.
    assert main(["data", "describe", "--dataset", "pacs", "--root", str(shared_data)]) == 1
    out = capsys.readouterr().out
    for domain, n in [
        ("art_painting", "2048"),
        ("cartoon", "2344"),
        ("photo", "1670"),
        ("sketch", "3929"),
    ]:
        assert domain in out and n in out.replace(",", "")
    text = " ".join(out.split())
    crossval = shared_data / "PACS" / "splits" / "art_painting_crossval_kfold.txt"
    assert "2 problem(s):" in text
    assert f"{crossval}:1: label 0 does not match the class folder of" in text
    assert f"{crossval}:17: art_painting/dog/pic_248.jpg is listed again" in text


def test_describe_missing_root_is_one_clear_line(tmp_path, capsys):
    assert main(["data", "describe", "--dataset", "pacs", "--root", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and "Traceback" not in err


def test_partition_writes_client_by_domain_counts(tmp_path, capsys):
    cfg = tmp_path / "p.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "dataset": {"name": "digits_embedded"},
                "split": {"scheme": "lodo", "targets": ["grey"], "val_fraction": 0.0},
                "partition": {"name": "lambda", "n_clients": 5, "lam": 0.0},
            }
        )
    )
    out = tmp_path / "counts.csv"
    assert main(["data", "partition", str(cfg), "--out", str(out)]) == 0
    rows = list(csv.reader((tmp_path / "counts_lodo-grey.csv").open()))
    assert rows[0][:5] == ["client", "grey", "mnistm", "inverted", "sketch"]
    body = [[int(v) for v in r[1:5]] for r in rows[1:] if r[0] != "total"]
    # lambda = 0, three equal sources of 1,250, 5 clients: main-domain counts start at (1, 1, 1)
    # and grow at argmax n_d / m_d (ties to the lowest index): (2, 1, 1), then (2, 2, 1). Each
    # main client holds 1,250 / m_d of its domain and nothing else.
    assert body == [[0, 625, 0, 0], [0, 625, 0, 0], [0, 0, 625, 0], [0, 0, 625, 0], [0, 0, 0, 1250]]


def test_report_reads_runs_and_writes_csv(tmp_path, capsys):
    run = tmp_path / "runs" / "fedavg"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "rounds": 2,
                "dataset": {"name": "digits_embedded"},
                "split": {"targets": ["sketch"]},
                "eval": {"every": 1},
                "checkpoint": {"every": 0},
                "threads": 1,
            }
        )
    )
    assert main(["run", str(cfg), "--out", str(run), "--quiet"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    capsys.readouterr()
    assert main(["report", str(tmp_path / "runs"), "--selection", "last"]) == 0
    out = capsys.readouterr().out
    assert "model selection: last" in out
    assert f"{100 * summary['final']['ood_acc']:.1f}" in out
    assert (tmp_path / "runs" / "report" / "report.csv").is_file()
