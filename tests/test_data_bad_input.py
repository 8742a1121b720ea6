"""Every kind of bad data input ends in a DataError naming the path at fault (or, where asked
for, a warning and a skip); ``describe`` reports the same problems instead of raising.
Damaged cache files are covered in test_cache.py."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from rich.console import Console

from feddomain.cli import main
from feddomain.data.describe import describe, render
from feddomain.data.sources import (
    DATASETS,
    DatasetSpec,
    load_dataset,
    load_split_list,
    official_split_indices,
)
from feddomain.errors import ConfigError, DataError


@pytest.fixture(autouse=True)
def tiny_specs(monkeypatch):
    """Two presets over the same folder layout, the second with official split lists."""
    monkeypatch.setitem(DATASETS, "Tiny", DatasetSpec("Tiny", "tiny_set", ("a", "b"), ("x", "y")))
    monkeypatch.setitem(
        DATASETS,
        "TinyLists",
        DatasetSpec(
            "TinyLists",
            "tiny_set",
            ("a", "b"),
            ("x", "y"),
            split_lists="lists/{domain}_{split}.txt",
            splits=("train", "val"),
        ),
    )


def colour(k: int) -> tuple[int, int, int]:
    return (10 * k, 255 - 10 * k, 7)


def make(base: Path, layout: dict[str, dict[str, int]]) -> Path:
    """``layout[domain][class]`` solid images ``<k>.png``; returns ``base``."""
    for domain, classes in layout.items():
        for cls, n in classes.items():
            (base / domain / cls).mkdir(parents=True, exist_ok=True)
            for k in range(n):
                Image.new("RGB", (8, 8), colour(k)).save(base / domain / cls / f"{k}.png")
    return base


GOOD = {"a": {"x": 3, "y": 3}, "b": {"x": 3, "y": 3}}


def load(root: Path, tmp_path: Path, name: str = "tiny", **kwargs):
    return load_dataset(name, root, 4, tmp_path / "cache", **kwargs)


def quoted(path: Path) -> str:
    return re.escape(str(path))


# --------------------------------------------------------------------------- roots and folders


def test_missing_root(tmp_path):
    with pytest.raises(DataError, match=f"data root {quoted(tmp_path / 'nowhere')} does not exist"):
        load(tmp_path / "nowhere", tmp_path)


def test_root_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(DataError, match=f"data root {quoted(tmp_path / 'f')} is not a directory"):
        load(tmp_path / "f", tmp_path)


def test_missing_dataset_folder(tmp_path):
    (tmp_path / "data" / "other").mkdir(parents=True)
    with pytest.raises(
        DataError, match=f"dataset folder {quoted(tmp_path / 'data' / 'tiny_set')} not found"
    ):
        load(tmp_path / "data", tmp_path)


def test_missing_domain_folder(tmp_path):
    make(tmp_path / "tiny_set", {"a": GOOD["a"]})
    with pytest.raises(
        DataError, match=f"missing domain folder {quoted(tmp_path / 'tiny_set' / 'b')}"
    ) as err:
        load(tmp_path, tmp_path)
    assert "unexpected" not in str(err.value)


def test_unexpected_domain_folder(tmp_path):
    make(tmp_path / "tiny_set", {**GOOD, "c": {"x": 1, "y": 1}})
    (tmp_path / "tiny_set" / "splits").mkdir()  # official-list folders are not domains
    with pytest.raises(
        DataError, match=f"unexpected domain folder {quoted(tmp_path / 'tiny_set' / 'c')}"
    ) as err:
        load(tmp_path, tmp_path)
    assert "splits" not in str(err.value)


def test_empty_class_folder(tmp_path):
    make(tmp_path / "tiny_set", {"a": {"x": 2, "y": 0}, "b": GOOD["b"]})
    (tmp_path / "tiny_set" / "a" / "y" / "notes.txt").write_text("not an image")
    with pytest.raises(DataError, match=f"empty class folder {quoted(tmp_path / 'tiny_set/a/y')}"):
        load(tmp_path, tmp_path)


def test_preset_class_missing_in_one_domain(tmp_path):
    make(tmp_path / "tiny_set", {"a": GOOD["a"], "b": {"x": 2}})
    with pytest.raises(
        DataError,
        match=f"{quoted(tmp_path / 'tiny_set' / 'b')} is missing class "
        r"folders \['y'\] compared with the Tiny classes",
    ):
        load(tmp_path, tmp_path)


def test_discovered_classes_that_differ_across_domains(tmp_path):
    make(tmp_path / "data", {"a": {"x": 1, "y": 1}, "b": {"x": 1, "z": 1, "w": 1}})
    with pytest.raises(
        DataError,
        match=f"{quoted(tmp_path / 'data' / 'b')} is missing class "
        r"folders \['y'\] and has extra class folders \['w', 'z'\] compared with "
        "domain a",
    ):
        load_dataset("folder", tmp_path / "data", 4, tmp_path / "cache")


def test_all_layout_problems_are_listed_in_one_error(tmp_path):
    make(tmp_path / "tiny_set", {"a": {"x": 1, "y": 0}, "c": {"x": 1}})
    with pytest.raises(DataError) as err:
        load(tmp_path, tmp_path)
    lines = str(err.value).splitlines()
    assert lines[0] == f"{tmp_path / 'tiny_set'} does not match the Tiny layout:"
    assert [line.split()[1:3] for line in lines[1:]] == [
        ["missing", "domain"],
        ["unexpected", "domain"],
        ["empty", "class"],
    ]


def test_bad_arguments(tmp_path):
    make(tmp_path / "tiny_set", GOOD)
    with pytest.raises(ConfigError, match="resolution must be a positive integer, got 0"):
        load_dataset("tiny", tmp_path, 0, tmp_path / "cache")
    with pytest.raises(DataError, match="dataset Tiny needs a data root"):
        load_dataset("tiny", None, 4, tmp_path / "cache")


# --------------------------------------------------------------------------- unreadable files


def corrupt(kind: str, path: Path) -> None:
    if kind == "not an image":
        path.write_text("these bytes are no image")
        return
    noise = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    Image.fromarray(noise).save(path, format="JPEG" if kind == "truncated jpeg" else "PNG")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


KINDS = ["not an image", "truncated jpeg", "truncated png"]


@pytest.mark.parametrize("kind", KINDS)
def test_one_corrupt_file_among_many_is_named(tmp_path, kind):
    make(tmp_path / "tiny_set", GOOD)
    bad = tmp_path / "tiny_set" / "b" / "x" / "1.jpg"
    corrupt(kind, bad)
    with pytest.raises(DataError, match=rf"1 image file\(s\) cannot be decoded: {quoted(bad)}: "):
        load(tmp_path, tmp_path)


@pytest.mark.parametrize("kind", KINDS)
def test_skip_corrupt_warns_skips_and_counts(tmp_path, caplog, kind):
    make(tmp_path / "tiny_set", GOOD)
    corrupt(kind, tmp_path / "tiny_set" / "b" / "x" / "1.jpg")
    with caplog.at_level(logging.WARNING, logger="feddomain.data.sources"):
        ds = load(tmp_path, tmp_path, skip_corrupt=True)
    assert "skipped 1 unreadable image file(s)" in caplog.text
    assert str(tmp_path / "tiny_set" / "b" / "x" / "1.jpg") in caplog.text
    assert ds.skipped == ("b/x/1.jpg",) and len(ds) == 12
    assert "b/x/1.jpg" not in ds.paths
    assert ds.counts().tolist() == [[3, 3], [3, 3]]  # the .jpg was a 4th file in b/x
    for row, rel in zip(ds.images, ds.paths, strict=True):  # rows stay aligned with files
        assert row[:, 0, 0].tolist() == list(colour(int(rel[-5])))


def test_a_cached_skip_still_fails_without_skip_corrupt(tmp_path):
    make(tmp_path / "tiny_set", GOOD)
    corrupt("not an image", tmp_path / "tiny_set" / "a" / "y" / "zz.png")
    load(tmp_path, tmp_path, skip_corrupt=True)
    with pytest.raises(DataError, match=quoted(tmp_path / "tiny_set" / "a" / "y" / "zz.png")):
        load(tmp_path, tmp_path)


def test_no_readable_image_at_all(tmp_path):
    make(tmp_path / "tiny_set", {"a": {"x": 0, "y": 0}, "b": {"x": 0, "y": 0}})
    for rel in ("a/x/0.png", "a/y/0.png", "b/x/0.png", "b/y/0.png"):
        corrupt("not an image", tmp_path / "tiny_set" / rel)
    with pytest.raises(
        DataError,
        match="none of the 4 image files in .* can be decoded, e.g. "
        f"{quoted(tmp_path / 'tiny_set' / 'a' / 'x' / '0.png')}",
    ):
        load(tmp_path, tmp_path, skip_corrupt=True)
    left = (tmp_path / "cache").glob("*") if (tmp_path / "cache").exists() else []
    assert [p for p in left if p.suffix != ".lock"] == []  # the empty lock file may stay


def test_non_image_files_are_ignored_by_extension(tmp_path):
    make(tmp_path / "tiny_set", GOOD)
    (tmp_path / "tiny_set" / "a" / "x" / "labels.csv").write_text("1,2")
    (tmp_path / "tiny_set" / "a" / "x" / ".DS_Store").write_text("")
    assert len(load(tmp_path, tmp_path)) == 12


# --------------------------------------------------------------------------- split lists


def write_list(root: Path, name: str, lines: list[str]) -> Path:
    path = root / "tiny_set" / "lists" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_split_list_missing(tmp_path):
    make(tmp_path / "tiny_set", GOOD)
    path = tmp_path / "tiny_set" / "lists" / "a_val.txt"
    with pytest.raises(DataError, match=f"split list {quoted(path)} not found"):
        load_split_list(tmp_path, "tinylists", "a", "val")


def test_split_list_naming_a_file_not_in_the_dataset(tmp_path):
    make(tmp_path / "tiny_set", GOOD)
    path = write_list(tmp_path, "a_train.txt", ["a/x/0.png 1", "a/y/7.png 2"])
    ds = load(tmp_path, tmp_path, "tinylists")
    with pytest.raises(DataError, match=f"split list {quoted(path)} names 1 file.* a/y/7.png"):
        official_split_indices(ds, tmp_path, "a", "train")


def test_split_list_maps_to_global_indices(tmp_path):
    make(tmp_path / "tiny_set", GOOD)
    write_list(tmp_path, "b_val.txt", ["b/y/2.png 2", "b/x/0.png 1"])
    ds = load(tmp_path, tmp_path, "tinylists")
    entries = load_split_list(tmp_path, "tinylists", "b", "val")
    assert entries == [("b/y/2.png", 1), ("b/x/0.png", 0)]
    # storage order a/x/0..2, a/y/0..2, b/x/0..2, b/y/0..2
    assert official_split_indices(ds, tmp_path, "b", "val").tolist() == [6, 11]


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("a/x/0.png", "expected '<domain>/<class>/<file> <label>'"),
        ("a/x/0.png one", "expected '<domain>/<class>/<file> <label>'"),
        ("b/x/0.png 1", "b/x/0.png is not in a class folder of TinyLists domain a"),
        ("a/q/0.png 1", "a/q/0.png is not in a class folder of TinyLists domain a"),
    ],
)
def test_malformed_split_list_line_is_named_with_its_number(tmp_path, line, says):
    make(tmp_path / "tiny_set", GOOD)
    path = write_list(tmp_path, "a_train.txt", ["a/x/1.png 1", line])
    with pytest.raises(DataError, match=f"{quoted(path)}:2: {re.escape(says)}"):
        load_split_list(tmp_path, "tinylists", "a", "train")


def test_wrong_split_or_domain_or_a_dataset_without_lists(tmp_path):
    make(tmp_path / "tiny_set", GOOD)
    with pytest.raises(DataError, match=r"unknown TinyLists split 'test'; splits: \['train', "):
        load_split_list(tmp_path, "tinylists", "a", "test")
    with pytest.raises(DataError, match="unknown TinyLists domain 'c'"):
        load_split_list(tmp_path, "tinylists", "c", "train")
    with pytest.raises(DataError, match="dataset VLCS has no official split lists"):
        load_split_list(tmp_path, "vlcs", "SUN09", "train")


# --------------------------------------------------------------------------- describe


def test_describe_reports_every_problem_instead_of_raising(tmp_path):
    make(tmp_path / "tiny_set", {"a": {"x": 3, "y": 0}, "c": {"x": 1}})
    bad = tmp_path / "tiny_set" / "a" / "x" / "9.png"
    corrupt("not an image", bad)
    report = describe("tiny", tmp_path)
    # rows: domains a, b (b is missing); the unreadable file is counted in a/x
    assert report.counts.tolist() == [[4, 0], [0, 0]]
    assert report.width == (8, 8) and report.modes == {"RGB": 3} and report.formats == {"PNG": 3}
    problems = "\n".join(report.problems)
    for expected in (
        f"missing domain folder {tmp_path / 'tiny_set' / 'b'}",
        f"unexpected domain folder {tmp_path / 'tiny_set' / 'c'}",
        f"empty class folder {tmp_path / 'tiny_set' / 'a' / 'y'}",
        f"unreadable image {bad}",
    ):
        assert expected in problems
    assert len(report.problems) == 4


def test_describe_deep_finds_truncated_files_that_headers_hide(tmp_path):
    make(tmp_path / "tiny_set", GOOD)
    bad = tmp_path / "tiny_set" / "b" / "y" / "0.png"
    corrupt("truncated png", bad)
    assert describe("tiny", tmp_path).problems == ()  # the header alone is intact
    (problem,) = describe("tiny", tmp_path, deep=True).problems
    assert problem.startswith(f"unreadable image {bad}: OSError")


def test_describe_renders_counts_sizes_and_problems(tmp_path):
    make(tmp_path / "tiny_set", {"a": {"x": 2, "y": 1}, "b": {"x": 1, "y": 0}})
    Image.new("L", (20, 6)).save(tmp_path / "tiny_set" / "b" / "x" / "wide.png")
    report = describe("tiny", tmp_path)
    console = Console(record=True, width=200)
    render(report, console)
    text = console.export_text()
    assert report.total == 5 and report.counts.tolist() == [[2, 1], [2, 0]]
    assert report.width == (8, 20) and report.height == (6, 8)
    assert report.modes == {"RGB": 4, "L": 1}
    assert "Tiny: 5 images in" in text and "width 8..20, height 6..8" in text
    assert "1 problem(s)" in text and "empty class folder" in text


def test_describe_checks_the_official_split_lists(tmp_path):
    make(tmp_path / "tiny_set", GOOD)
    write_list(tmp_path, "a_val.txt", ["a/x/0.png 1"])  # a correct list: no problem
    bad = write_list(
        tmp_path, "a_train.txt", ["a/x/1.png 2", "a/y/0.png 2", "a/y/0.png 2", "a/y/5.png 2"]
    )
    report = describe("tinylists", tmp_path)
    assert report.counts.tolist() == [[3, 3], [3, 3]]
    lists = tmp_path / "tiny_set" / "lists"
    assert list(report.problems) == [
        f"{bad}:1: label 2 does not match the class folder of a/x/1.png; using 1 (x)",
        f"{bad}:3: a/y/0.png is listed again; the repeat is ignored",
        f"split list {bad} names 1 missing file(s), e.g. a/y/5.png",
        f"split list {lists / 'b_train.txt'} not found",
        f"split list {lists / 'b_val.txt'} not found",
    ]


def describe_command(root: Path, *flags: str) -> int:
    return main(["data", "describe", "--dataset", "tiny", "--root", str(root), *flags])


def test_describe_command_exits_0_on_a_clean_folder(tmp_path, capsys):
    """Catches `feddomain data describe` failing (exit status != 0) on a folder with no problem."""
    make(tmp_path / "tiny_set", GOOD)
    assert describe_command(tmp_path) == 0
    assert describe_command(tmp_path, "--deep") == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Tiny: 12 images in" in out and "no problems found" in out and "problem(s)" not in out


@pytest.mark.parametrize("damage", ["unreadable image", "empty class folder", "missing domain"])
def test_describe_command_exits_1_and_names_the_problem(tmp_path, capsys, damage):
    """Catches `feddomain data describe` exiting 0, as if the folder were fine, while it lists
    problems (a script or CI step gating on it would go on to train on a broken folder)."""
    root = tmp_path / "tiny_set"
    if damage == "unreadable image":
        make(root, GOOD)
        bad = root / "b" / "y" / "2.png"
        corrupt("not an image", bad)
        expected = f"unreadable image {bad}: "
    elif damage == "empty class folder":
        make(root, {"a": {"x": 3, "y": 0}, "b": GOOD["b"]})
        expected = f"empty class folder {root / 'a' / 'y'}"
    else:
        make(root, {"a": GOOD["a"]})
        expected = f"missing domain folder {root / 'b'}"
    assert describe_command(tmp_path) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "1 problem(s):" in out and expected in out


def test_describe_command_exit_status_follows_deep_decoding(tmp_path, capsys):
    """Catches an exit status that ignores the problems only --deep finds (a truncated image)."""
    make(tmp_path / "tiny_set", GOOD)
    bad = tmp_path / "tiny_set" / "a" / "x" / "0.png"
    corrupt("truncated png", bad)
    assert describe_command(tmp_path) == 0  # the header alone is intact
    assert describe_command(tmp_path, "--deep") == 1
    out = " ".join(capsys.readouterr().out.split())
    assert f"unreadable image {bad}: OSError" in out
