"""IWildCam in the WILDS 2.0 layout (a small folder the tests write: metadata.csv, tiny JPEGs),
its official splits as a federation, and macro-F1."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from feddomain.cli import run_experiment
from feddomain.config import validate_config
from feddomain.data.federated import federations
from feddomain.data.sources import load_dataset
from feddomain.data.splits import share_like
from feddomain.errors import ConfigError, DataError
from feddomain.evaluation.metrics import macro_f1

# location -> {split: images}; labels cycle through 0, 1, 3 (class 2 has no image)
LAYOUT = {
    0: {"train": 6, "id_val": 2, "id_test": 1},
    1: {"train": 4, "id_val": 2},
    2: {"train": 3},
    7: {"val": 3},
    10: {"test": 4},
    12: {"test": 2},
}
LABELS = (0, 1, 3)


def write_wilds(root: Path) -> Path:
    folder = root / "iwildcam_v2.0"
    (folder / "train").mkdir(parents=True)
    rows, k = [], 0
    for loc, splits in LAYOUT.items():
        for split, n in splits.items():
            for _ in range(n):
                name = f"img{k:03d}.jpg"
                Image.new("RGB", (12, 10), (10 * k % 255, 40, 90)).save(folder / "train" / name)
                rows.append(
                    {"split": split, "location_remapped": loc, "y": LABELS[k % 3],
                     "filename": name, "sequence_remapped": 0}
                )  # fmt: skip
                k += 1
    with open(folder / "metadata.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (folder / "categories.csv").write_text("y,category_id,name\n0,0,empty\n1,3,deer\n3,8,fox\n")
    return folder


@pytest.fixture
def wilds_root(tmp_path) -> Path:
    write_wilds(tmp_path)
    return tmp_path


def _config(root: Path, cache: Path, **partition) -> dict:
    return {
        "rounds": 1,
        "dataset": {
            "name": "IWildCam",
            "root": str(root),
            "resolution": 8,
            "cache_dir": str(cache),
        },
        "split": {"scheme": "wilds"},
        "partition": {"name": "lambda", "lam": 0.0, "n_clients": 3, **partition},
        "model": {"name": "small_cnn", "options": {"widths": [4, 4, 4]}},
        "checkpoint": {"every": 0},
        "threads": 1,
    }


def test_metadata_gives_each_image_its_location_label_and_split(wilds_root, tmp_path):
    """Catches locations numbered by order of appearance instead of location_remapped, labels
    re-indexed over the classes present, or splits attached to the wrong images."""
    ds = load_dataset("IWildCam", wilds_root, 8, tmp_path / "cache")
    assert ds.domains == tuple(f"location_{k}" for k in (0, 1, 2, 7, 10, 12))
    assert ds.classes == ("empty", "deer", "class_2", "fox")
    assert len(ds) == 27 and ds.images.shape == (27, 3, 8, 8)
    assert ds.official_splits[:9] == ("train",) * 6 + ("id_val",) * 2 + ("id_test",)
    assert ds.labels[:4].tolist() == [0, 1, 3, 0]
    assert ds.counts().sum(axis=1).tolist() == [9, 6, 3, 3, 4, 2]


def test_lambda_zero_gives_each_client_one_location_and_its_own_id_val(wilds_root, tmp_path):
    """Catches clients mixing locations at lambda = 0, validation drawn from other locations
    (or from train images), and the held-out sets scored per location instead of pooled."""
    (fed,) = federations(validate_config(_config(wilds_root, tmp_path / "c")))
    assert fed.split.name == "wilds"
    assert fed.split.train == ("location_0", "location_1", "location_2")
    counts = fed.client_domain_counts
    assert counts[:, :3].tolist() == [[6, 0, 0], [0, 4, 0], [0, 0, 3]]
    assert [len(v) for v in fed.val] == [2, 2, 0]  # each location's own id_val images
    assert list(fed.targets) == ["test"] and len(fed.targets["test"]) == 6
    assert list(fed.ood_val) == ["val"] and len(fed.ood_val["val"]) == 3


def test_lambda_one_spreads_every_location_over_the_clients(wilds_root, tmp_path):
    """Catches the lambda splitter bypassed for WILDS: at lambda = 1 each client holds a share
    of every training location, and all 13 train images are dealt exactly once."""
    (fed,) = federations(validate_config(_config(wilds_root, tmp_path / "c", lam=1.0)))
    counts = fed.client_domain_counts[:, :3]
    assert counts.sum(axis=0).tolist() == [6, 4, 3]
    assert (counts > 0).all()
    assert sum(len(v) for v in fed.val) == 4  # the 2 + 2 id_val images, none lost


def test_share_like_follows_each_clients_mix_by_largest_remainder():
    """Catches validation shares not proportional to the training mix, lost indices, or
    a group no client trains on handed out anyway."""
    group_of = np.array([0, 0, 0, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1])
    parts = [np.array([0, 3]), np.array([1, 2, 4]), np.array([5, 6])]
    # group 0: weights 1, 2, 0 of 5 ids -> quotas 5/3, 10/3, 0 -> 2, 3, 0 (largest remainder)
    # group 1: weights 1, 1, 2 of 2 ids -> quotas 0.5, 0.5, 1 -> 1 (tie: lower client), 0, 1
    groups = [np.arange(7, 12), np.arange(12, 14), np.array([20])]
    out = share_like(groups, parts, group_of, seed=3)
    assert [len(o) for o in out] == [3, 3, 1]
    assert sorted(np.concatenate(out).tolist()) == list(range(7, 14))
    assert np.isin(out[1], groups[0]).all() and np.isin(out[2], groups[1]).all()


def test_a_wilds_folder_without_metadata_is_named(tmp_path):
    """Catches a bare FileNotFoundError (or an empty dataset) when metadata.csv is missing."""
    (tmp_path / "iwildcam_v2.0" / "train").mkdir(parents=True)
    with pytest.raises(DataError, match=r"no metadata\.csv in .*iwildcam_v2\.0"):
        load_dataset("IWildCam", tmp_path, 8, tmp_path / "cache")


def test_bad_metadata_rows_and_missing_images_are_named(wilds_root, tmp_path):
    """Catches an unknown split value or a missing image accepted (or reported without the file
    and line)."""
    folder = wilds_root / "iwildcam_v2.0"
    (folder / "train" / "img004.jpg").unlink()
    with pytest.raises(DataError, match=r"1 image\(s\) named in .*metadata\.csv.*img004\.jpg"):
        load_dataset("IWildCam", wilds_root, 8, tmp_path / "cache")
    meta = folder / "metadata.csv"
    meta.write_text(meta.read_text().replace("id_test", "holdout"))
    with pytest.raises(DataError, match=r"metadata\.csv:10: split 'holdout' is not one of"):
        load_dataset("IWildCam", wilds_root, 8, tmp_path / "cache")


def test_wilds_scheme_and_dataset_go_together(wilds_root, tmp_path):
    """Catches IWildCam run leave-one-location-out by default, or `wilds` asked of PACS."""
    raw = _config(wilds_root, tmp_path)
    raw["split"] = {"scheme": "lodo"}
    with pytest.raises(ConfigError, match=r"'split.scheme' = 'lodo' with dataset 'IWildCam'"):
        validate_config(raw)
    with pytest.raises(ConfigError, match=r"'split.scheme' = 'wilds' with dataset 'PACS'"):
        validate_config({"dataset": {"name": "PACS"}, "split": {"scheme": "wilds"}})


def test_a_wilds_run_reports_accuracy_and_macro_f1_on_the_pooled_test_set(wilds_root, tmp_path):
    """Catches the IWildCam preset failing inside a run, or macro-F1 missing from its summary."""
    raw = _config(wilds_root, tmp_path / "cache")
    (run,) = run_experiment(validate_config(raw), tmp_path / "run", quiet=True)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["split"] == "wilds" and list(summary["per_domain"]) == ["test"]
    assert summary["n_clients"] == 3 and 0 <= summary["ood_macro_f1"] <= 1


def test_macro_f1_averages_the_true_classes_f1():
    """Catches F1 averaged over every class (a class absent from the labels counts 0), or
    weighted by support: WILDS' macro-F1 averages the classes present in the labels."""
    labels = torch.tensor([0, 0, 0, 1, 1, 2])
    pred = torch.tensor([0, 0, 1, 1, 3, 0])
    scores = torch.nn.functional.one_hot(pred, 4).float()
    # class 0: TP 2, FP 1, FN 1 -> 4/6; class 1: TP 1, FP 1, FN 1 -> 2/4; class 2: 0
    assert macro_f1(scores, labels) == pytest.approx((4 / 6 + 2 / 4 + 0) / 3, abs=1e-12)
