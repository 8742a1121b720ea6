"""Dataset registry, folder scanning and the image-folder loader (tiny generated folders + real
PACS). Bad-input handling has its own file, test_data_bad_input.py."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from feddomain.data import sources
from feddomain.data.sources import (
    DATASETS,
    DatasetSpec,
    get_spec,
    load_dataset,
    load_split_list,
    official_split_indices,
    scan_image_folder,
)
from feddomain.errors import DataError

PACS_DOMAINS = ("art_painting", "cartoon", "photo", "sketch")
PACS_CLASSES = ("dog", "elephant", "giraffe", "guitar", "horse", "house", "person")
PACS_SIZES = {  # ../shared/data/README.md: images, official train, official crossval
    "art_painting": (2048, 1840, 208),
    "cartoon": (2344, 2107, 237),
    "photo": (1670, 1499, 171),
    "sketch": (3929, 3531, 398),
}


def solid(path: Path, colour: tuple[int, int, int], size: tuple[int, int] = (12, 12)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)


def colour_of(domain: int, cls: int, k: int) -> tuple[int, int, int]:
    """A distinct colour per file, so each decoded row tells which file it came from."""
    return (40 * domain + 10, 40 * cls + 10, 20 * k + 10)


def make_tree(base: Path, domains: dict[str, dict[str, int]]) -> None:
    """``domains[d][c]`` solid PNG files ``img<k>.png`` in ``base/d/c``."""
    for d_id, (domain, classes) in enumerate(sorted(domains.items())):
        for c_id, (cls, n) in enumerate(sorted(classes.items())):
            for k in range(n):
                solid(base / domain / cls / f"img{k}.png", colour_of(d_id, c_id, k))


# --------------------------------------------------------------------------- registry


def test_lookup_ignores_case_underscores_and_dashes():
    assert get_spec("pacs") is DATASETS["PACS"]
    assert get_spec("office_home") is DATASETS["OfficeHome"]
    assert get_spec("Terra-Incognita") is DATASETS["TerraIncognita"]
    assert get_spec("DIGITS3") is DATASETS["Digits3"]


def test_unknown_name_lists_valid_names_and_closest_match():
    with pytest.raises(DataError, match=r"unknown dataset 'pacss'; did you mean 'PACS'\?") as err:
        get_spec("pacss")
    assert all(name in str(err.value) for name in DATASETS)
    with pytest.raises(DataError, match="did you mean 'OfficeHome'"):
        get_spec("office-hme")


def test_presets_match_the_published_layouts():
    assert DATASETS["PACS"].domains == PACS_DOMAINS
    assert DATASETS["PACS"].classes == PACS_CLASSES  # the order of the 1-based split labels
    office = DATASETS["OfficeHome"].classes
    assert len(set(office)) == 65 and list(office) == sorted(office)
    assert {"Alarm_Clock", "Postit_Notes", "TV", "Webcam"} <= set(office)
    assert DATASETS["VLCS"].classes == ("bird", "car", "chair", "dog", "person")
    assert DATASETS["Digits3"].classes == tuple("0123456789")
    assert DATASETS["DomainNet"].classes is None and DATASETS["TerraIncognita"].classes is None
    assert DATASETS["folder"].domains is None and DATASETS["folder"].folder is None


# --------------------------------------------------------------------------- folder loading


def test_generic_folder_discovers_sorted_domains_classes_and_keeps_row_file_alignment(tmp_path):
    make_tree(tmp_path / "data", {"b": {"y": 2, "x": 1}, "a": {"y": 1, "x": 3}})
    ds = load_dataset("folder", tmp_path / "data", 4, tmp_path / "cache")
    assert ds.domains == ("a", "b") and ds.classes == ("x", "y")
    assert ds.paths == (
        "a/x/img0.png",
        "a/x/img1.png",
        "a/x/img2.png",
        "a/y/img0.png",
        "b/x/img0.png",
        "b/y/img0.png",
        "b/y/img1.png",
    )
    assert ds.labels.tolist() == [0, 0, 0, 1, 0, 1, 1]
    assert ds.domain_ids.tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert ds.images.shape == (7, 3, 4, 4) and ds.images.dtype == torch.uint8
    for row, rel in zip(ds.images, ds.paths, strict=True):
        d, c, name = rel.split("/")
        expected = colour_of(ds.domains.index(d), ds.classes.index(c), int(name[3]))
        block = torch.tensor(expected, dtype=torch.uint8).view(3, 1, 1).expand(3, 4, 4)
        assert torch.equal(row, block)
    assert ds.skipped == ()


def test_every_mode_becomes_rgb_and_any_shape_becomes_square(tmp_path):
    root = tmp_path / "data" / "dom"
    root.joinpath("c").mkdir(parents=True)
    Image.new("L", (30, 10), 77).save(root / "c" / "0grey.png")
    Image.new("RGBA", (10, 30), (10, 20, 30, 255)).save(root / "c" / "1rgba.png")
    palette = Image.new("P", (5, 5), 1)
    palette.putpalette([0, 0, 0, 200, 100, 0])  # index 1 -> (200, 100, 0)
    palette.save(root / "c" / "2palette.png")
    Image.new("1", (8, 8), 1).save(root / "c" / "3bilevel.bmp")
    ds = load_dataset("folder", tmp_path / "data", 6, tmp_path / "cache")
    expected = [(77, 77, 77), (10, 20, 30), (200, 100, 0), (255, 255, 255)]
    assert ds.images.shape == (4, 3, 6, 6)
    for row, colour in zip(ds.images, expected, strict=True):
        assert row.reshape(3, -1).unique(dim=1).flatten().tolist() == list(colour)


def test_resize_is_antialiased(tmp_path):
    # One-pixel stripes 0/255: an antialiased 8x downscale averages them to ~127 everywhere,
    # whereas point sampling (no antialias) would return stripes of 0 and 255.
    stripes = np.zeros((64, 64, 3), dtype=np.uint8)
    stripes[:, 1::2] = 255
    halves = np.zeros((64, 64, 3), dtype=np.uint8)
    halves[:, 32:] = 255
    folder = tmp_path / "data" / "d" / "c"
    folder.mkdir(parents=True)
    Image.fromarray(stripes).save(folder / "a.png")
    Image.fromarray(halves).save(folder / "b.png")
    ds = load_dataset("folder", tmp_path / "data", 8, tmp_path / "cache")
    assert ds.images[0].min() >= 120 and ds.images[0].max() <= 135
    left_to_right = ds.images[1][0, 0].tolist()
    assert left_to_right[0] == 0 and left_to_right[-1] == 255
    assert left_to_right == sorted(left_to_right)


@pytest.fixture()
def tiny_spec(monkeypatch):
    """A preset registered the way a new dataset would be: one DATASETS entry."""
    spec = DatasetSpec(
        "Tiny",
        "tiny_set",
        ("a", "b"),
        ("x", "y"),
        split_lists="lists/{domain}_{split}.txt",
        splits=("train", "val"),
    )
    monkeypatch.setitem(DATASETS, "Tiny", spec)
    return spec


def test_root_may_contain_the_dataset_folder_or_be_it(tmp_path, tiny_spec):
    make_tree(tmp_path / "tiny_set", {"a": {"x": 2, "y": 1}, "b": {"x": 1, "y": 2}})
    outer = load_dataset("tiny", tmp_path, 5, tmp_path / "cache")
    inner = load_dataset("tiny", tmp_path / "tiny_set", 5, tmp_path / "cache")
    assert outer.name == "Tiny" and outer.paths == inner.paths and len(outer) == 6
    assert torch.equal(outer.images, inner.images)
    assert outer.counts().tolist() == [[2, 1], [1, 2]]


def test_scan_lists_sizes_and_mtimes_without_decoding(tmp_path, monkeypatch):
    make_tree(tmp_path, {"a": {"x": 2}, "b": {"x": 1}})
    os.utime(tmp_path / "a" / "x" / "img1.png", ns=(1, 123_456_789))

    def no_decode(*args, **kwargs):
        raise AssertionError("scanning must not open images")

    monkeypatch.setattr(Image, "open", no_decode)
    index = scan_image_folder(tmp_path, get_spec("folder"))
    assert index.paths == ("a/x/img0.png", "a/x/img1.png", "b/x/img0.png")
    assert index.sizes.tolist() == [os.path.getsize(tmp_path / p) for p in index.paths]
    assert index.mtimes_ns[1] == 123_456_789
    assert index.domain_ids.tolist() == [0, 0, 1] and index.labels.tolist() == [0, 0, 0]


def test_parallel_decode_gives_the_same_rows_as_one_process(tmp_path, monkeypatch):
    make_tree(tmp_path / "data", {"a": {"x": 4, "y": 3}, "b": {"x": 3, "y": 1}})
    serial = load_dataset("folder", tmp_path / "data", 3, tmp_path / "serial")
    monkeypatch.setattr(sources, "DECODE_CHUNK", 2)  # 6 chunks over min(2, cpus) processes
    parallel = load_dataset("folder", tmp_path / "data", 3, tmp_path / "parallel")
    assert torch.equal(serial.images, parallel.images) and serial.paths == parallel.paths
    assert torch.equal(serial.labels, parallel.labels)


# --------------------------------------------------------------------------- real PACS


@pytest.fixture(scope="session")
def pacs32(shared_data, cache_dir):
    """PACS at 32 px, decoded at most once per test session (the shared cache_dir)."""
    return load_dataset("PACS", shared_data, 32, cache_dir)


def test_pacs_counts_per_domain_and_class_match_the_folders(pacs32, shared_data):
    assert pacs32.domains == PACS_DOMAINS and pacs32.classes == PACS_CLASSES
    assert pacs32.images.shape == (9991, 3, 32, 32)
    counts = pacs32.counts()
    assert counts.sum(axis=1).tolist() == [PACS_SIZES[d][0] for d in PACS_DOMAINS]
    listed = [
        [len(os.listdir(shared_data / "PACS" / d / c)) for c in PACS_CLASSES] for d in PACS_DOMAINS
    ]
    assert counts.tolist() == listed


def test_pacs_rows_are_the_listed_files_resized(pacs32, shared_data):
    for i in (0, 2047, 2048, 5000, 9990):
        with Image.open(shared_data / "PACS" / pacs32.paths[i]) as img:
            ref = img.convert("RGB").resize((32, 32), Image.Resampling.BILINEAR)
        assert torch.equal(pacs32.images[i], torch.from_numpy(np.array(ref)).permute(2, 0, 1))
        domain, cls, _ = pacs32.paths[i].split("/")
        assert pacs32.domains[pacs32.domain_ids[i]] == domain
        assert pacs32.classes[pacs32.labels[i]] == cls


def read_raw_list(shared_data: Path, domain: str, split: str) -> list[tuple[str, int]]:
    text = (shared_data / "PACS" / "splits" / f"{domain}_{split}_kfold.txt").read_text()
    return [(line.split()[0], int(line.split()[1])) for line in text.splitlines() if line.strip()]


def test_pacs_list_labels_equal_folder_labels_except_one_known_defect(shared_data):
    # Read the raw files here, independently of the loader: every 1-based label is the class
    # folder's position in the class list, except line 1 of art_painting's crossval list
    # ("art_painting/dog/pic_225.jpg 0"), a defect of the list file itself.
    wrong = []
    for domain in PACS_DOMAINS:
        for split in ("train", "crossval", "test"):
            for lineno, (rel, label) in enumerate(read_raw_list(shared_data, domain, split), 1):
                if label != PACS_CLASSES.index(rel.split("/")[1]) + 1:
                    wrong.append((domain, split, lineno))
    assert wrong == [("art_painting", "crossval", 1)]


def test_pacs_split_list_defects_are_reported_and_repaired_from_the_folders(shared_data, caplog):
    entries = load_split_list(shared_data, "pacs", "art_painting", "crossval")
    raw = read_raw_list(shared_data, "art_painting", "crossval")
    messages = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(messages) == 2
    assert messages[0].endswith(
        "art_painting_crossval_kfold.txt:1: label 0 does not match the "
        "class folder of art_painting/dog/pic_225.jpg; using 1 (dog)"
    )
    assert "crossval_kfold.txt:17: art_painting/dog/pic_248.jpg is listed again" in messages[1]
    assert [rel for rel, _ in entries] == [rel for k, (rel, _) in enumerate(raw) if k != 16]
    assert [label for _, label in entries] == [
        PACS_CLASSES.index(rel.split("/")[1]) for rel, _ in entries
    ]


# art_painting's crossval list repeats pic_248 where the file order says pic_249 belongs, so
# pic_249 is in neither list; the other domains' lists partition them exactly.
UNLISTED = {"art_painting": {"art_painting/dog/pic_249.jpg"}}


@pytest.mark.parametrize("domain", PACS_DOMAINS)
def test_pacs_official_lists_partition_each_domain(pacs32, shared_data, domain):
    n, n_train, n_val = PACS_SIZES[domain]
    unlisted = UNLISTED.get(domain, set())
    splits = ("train", "crossval", "test")
    lists = {s: load_split_list(shared_data, "pacs", domain, s) for s in splits}
    for entries in lists.values():
        assert all(0 <= label < 7 for _, label in entries)
        assert all(rel.startswith(f"{domain}/") for rel, _ in entries)
    train, val, test = (official_split_indices(pacs32, shared_data, domain, s) for s in splits)
    assert (len(train), len(val), len(test)) == (n_train, n_val - len(unlisted), n)
    assert np.intersect1d(train, val).size == 0
    whole = pacs32.indices_of(domain)
    assert np.array_equal(test, whole)
    left_out = np.setdiff1d(whole, np.union1d(train, val))
    assert {pacs32.paths[i] for i in left_out} == unlisted
    position = {rel: i for i, rel in enumerate(pacs32.paths)}
    for entries in lists.values():  # list labels == labels of the loaded (folder-labelled) rows
        assert [int(pacs32.labels[position[rel]]) for rel, _ in entries] == [
            label for _, label in entries
        ]
