"""`feddomain adapt` / `feddomain evaluate`: a new site's model from a finished FedVR run and a
folder of its unlabeled images, and the refusals that protect it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from feddomain.adapt import load_model_file, load_run
from feddomain.cli import main
from feddomain.config import load_config

CONFIG = {
    "rounds": 2,
    "seed": 0,
    "threads": 1,
    "dataset": {"name": "digits_embedded", "resolution": 16},
    "split": {"scheme": "lodo", "targets": ["grey"], "pilot_fraction": 0.1},
    "partition": {"n_clients": 3, "d": 1},
    "model": {"name": "lenet5", "frozen": True, "head_adapter": 8},
    "train": {"batch_size": 64, "optimizer": "sgd", "lr": 0.05, "momentum": 0.9, "drop_last": True},
    "eval": {"every": 1},
    "checkpoint": {"every": 0},
    "algorithm": {"name": "fedvr", "embed_dim": 8, "hidden": 16, "encoder_hidden": 16},
}


def write_png_folder(folder: Path, images: torch.Tensor, labels=None, classes=None) -> Path:
    """Images as PNG (lossless): flat, or in <class>/ folders when labels are given."""
    for i, img in enumerate(images):
        sub = folder if labels is None else folder / classes[int(labels[i])]
        sub.mkdir(parents=True, exist_ok=True)
        Image.fromarray(img.permute(1, 2, 0).numpy()).save(sub / f"{i:05d}.png")
    return folder


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One finished FedVR run on the embedded digits (frozen LeNet-5 features), its pilot and
    target images written as PNG folders, and a second run (another seed)."""
    root = tmp_path_factory.mktemp("adapt")
    out = {}
    for seed in (0, 1):
        config = root / f"fedvr{seed}.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    **CONFIG,
                    "seed": seed,
                    "dataset": {**CONFIG["dataset"], "cache_dir": str(root / "cache")},
                }
            )
        )
        assert main(["run", str(config), "--out", str(root / f"run{seed}"), "--quiet"]) == 0
        out[seed] = root / f"run{seed}"
    cfg = load_config(root / "fedvr0.yaml")
    dataset_images = _raw_target(cfg)
    pilot, target, labels, classes = dataset_images
    return {
        "root": root,
        "run": out[0],
        "other": out[1],
        "pilot": write_png_folder(root / "pilot", pilot),
        "target": write_png_folder(root / "target", target, labels, classes),
        "target_images": target,
        "classes": classes,
    }


def _raw_target(cfg):
    """The grey domain's pilot images and its evaluated images (uint8), as the run split them."""
    from feddomain.data.federated import load_experiment_dataset
    from feddomain.data.splits import pilot_split
    from feddomain.federation.topology import PILOT_SPLIT, derive_seed

    dataset = load_experiment_dataset(cfg)
    grey = dataset.domains.index("grey")
    idx = np.flatnonzero((dataset.domain_ids == grey).numpy())
    evaluated, pilot = pilot_split(idx, 0.1, "grey", seed=derive_seed(cfg.seed, PILOT_SPLIT))
    return (
        dataset.images[pilot],
        dataset.images[evaluated],
        dataset.labels[evaluated],
        dataset.classes,
    )


def test_adapt_on_the_runs_own_pilot_images_gives_its_zero_shot_model(trained, tmp_path, capsys):
    """Catches an adapt path that differs from the run's zero-shot model (other backbone,
    normalisation, statistics or generation): the same pilot images, read back from PNG files,
    must give the model the run scored as ood, and `evaluate` its ood accuracy."""
    model_file = tmp_path / "site.pt"
    assert (
        main(
            [
                "adapt",
                str(trained["run"]),
                "--pilot",
                str(trained["pilot"]),
                "--out",
                str(model_file),
            ]
        )
        == 0
    )
    line = said(capsys)
    assert line.startswith("adapt: zero-shot model for") and "no labels read" in line
    payload = load_model_file(model_file)
    run = load_run(trained["run"])
    (domain,) = run.server.pilot
    expected = run.server.synthesise(run.server.pilot[domain])
    for k, v in expected.items():
        assert torch.allclose(payload["arrays"][k], v.detach(), atol=1e-5, rtol=1e-5), k
    assert payload["classes"] == list(trained["classes"])
    assert main(["evaluate", str(model_file), str(trained["target"])]) == 0
    line = said(capsys)
    summary = json.loads((trained["run"] / "summary.json").read_text())
    assert f"accuracy {100 * summary['final']['ood_acc']:.1f}%" in line


def test_few_shot_fine_tunes_the_zero_shot_model_on_the_labelled_shots(trained, tmp_path, capsys):
    """Catches a few-shot variant that does not train (same arrays as zero-shot) or trains on
    something else than the shots (their loss must fall)."""
    images, classes = trained["target_images"][:40], trained["classes"]
    run = load_run(trained["run"])
    shots = write_png_folder(tmp_path / "shots", images, torch.arange(40) % len(classes), classes)
    zero, few = tmp_path / "zero.pt", tmp_path / "few.pt"
    assert main(["adapt", str(trained["run"]), "--pilot", str(shots), "--out", str(zero)]) == 0
    assert (
        main(
            [
                "adapt",
                str(trained["run"]),
                "--shots",
                str(shots),
                "--epochs",
                "20",
                "--out",
                str(few),
            ]
        )
        == 0
    )
    assert "few-shot (40 labelled images)" in said(capsys)
    from feddomain.adapt import features, read_images

    data = read_images(shots, 16, classes=classes, resize=False, what="shots")
    x = features(run.cfg, data.images, len(classes))
    model = run.server.ctx.model_factory()

    def loss(arrays) -> float:
        model.load_state_dict(arrays)
        with torch.no_grad():
            return float(torch.nn.functional.cross_entropy(model(x), data.labels))

    assert loss(load_model_file(few)["arrays"]) < loss(load_model_file(zero)["arrays"])


def said(capsys) -> str:
    """Everything printed (the report on stdout, errors on stderr), unwrapped."""
    out, err = capsys.readouterr()
    return (out + err).replace("\n", "")


def _adapt(trained, pilot: Path, out: Path, *extra: str) -> int:
    return main(["adapt", str(trained["run"]), "--pilot", str(pilot), "--out", str(out), *extra])


def test_an_empty_missing_or_unreadable_pilot_folder_is_refused_by_name(trained, tmp_path, capsys):
    """Catches a zero-shot model built from nothing or from an unreadable file."""
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _adapt(trained, empty, tmp_path / "a.pt") == 2
    assert f"pilot folder {empty} holds no images" in said(capsys)
    assert _adapt(trained, tmp_path / "nowhere", tmp_path / "a.pt") == 2
    assert "does not exist" in said(capsys)
    broken = tmp_path / "broken"
    shutil.copytree(trained["pilot"], broken)
    (broken / "zz.png").write_bytes(b"not a png")
    assert _adapt(trained, broken, tmp_path / "a.pt") == 2
    out = said(capsys)
    assert "zz.png" in out and "cannot be decoded" in out
    assert not (tmp_path / "a.pt").exists()


def test_a_pilot_set_of_another_class_list_or_image_size_is_refused(trained, tmp_path, capsys):
    """Catches a pilot set from another task (class folders the model does not know) or of
    another image size silently used; --resize is the explicit way to accept the latter."""
    images = trained["target_images"][:6]
    other = write_png_folder(tmp_path / "other", images, torch.zeros(6), ["zebra"])
    assert _adapt(trained, other, tmp_path / "a.pt") == 2
    assert "class folders ['zebra']" in said(capsys)
    big = tmp_path / "big"
    big.mkdir()
    for i, img in enumerate(images):
        Image.fromarray(img.permute(1, 2, 0).numpy()).resize((20, 20)).save(big / f"{i}.png")
    assert _adapt(trained, big, tmp_path / "a.pt") == 2
    out = said(capsys)
    assert "is 20x20 px" in out and "16x16" in out and "--resize" in out
    assert _adapt(trained, big, tmp_path / "a.pt", "--resize") == 0


def test_a_model_file_from_another_run_is_refused(trained, tmp_path, capsys):
    """Catches a server_state.pt copied in from another run (here: another seed) being used
    as if it were this run's hypernetwork."""
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    shutil.copy(trained["other"] / "server_state.pt", run / "server_state.pt")
    assert _adapt({"run": run}, trained["pilot"], tmp_path / "a.pt") == 2
    out = said(capsys)
    assert "server_state.pt is not this run's model" in out


def test_a_run_of_another_method_and_a_foreign_model_file_are_refused(tmp_path, capsys):
    """Catches adapt accepting a run with no hypernetwork, and evaluate reading any file."""
    config = tmp_path / "fedavg.yaml"
    config.write_text(yaml.safe_dump({**CONFIG, "rounds": 1, "algorithm": {"name": "fedavg"}}))
    assert main(["run", str(config), "--out", str(tmp_path / "run"), "--quiet"]) == 0
    pilot = tmp_path / "p"
    pilot.mkdir()
    assert (
        main(
            ["adapt", str(tmp_path / "run"), "--pilot", str(pilot), "--out", str(tmp_path / "a.pt")]
        )
        == 2
    )
    assert "is a fedavg run; adapt needs a FedVR run" in said(capsys)
    torch.save({"weights": torch.zeros(1)}, tmp_path / "foreign.pt")
    assert main(["evaluate", str(tmp_path / "foreign.pt"), str(pilot)]) == 2
    assert "is not a model file written by `feddomain adapt`" in said(capsys)


def test_labelled_folders_with_some_classes_keep_the_models_class_order(
    trained, tmp_path, capsys
):
    """Catches labels numbered by the class folders found instead of the model's class list:
    a folder with two of the model's classes (the one it predicts most on the target, and
    another) must score its predictions against those classes' own indices — numbered 0 and 1
    by the folders found, the accuracy would be another. `evaluate` prints the accuracy
    computed here from the model file's own head."""
    from feddomain.adapt import features, read_images
    from feddomain.federation.training import set_arrays
    from feddomain.models.frozen import head_model

    classes = trained["classes"]
    model_file = tmp_path / "site.pt"
    args = ["adapt", str(trained["run"]), "--pilot", str(trained["pilot"]), "--out"]
    assert main([*args, str(model_file)]) == 0
    said(capsys)
    payload = load_model_file(model_file)
    run = load_run(trained["run"])
    m = run.cfg.model
    head = head_model(
        payload["n_features"], len(classes), hidden=m.head_hidden, adapter=m.head_adapter
    )
    set_arrays(head, payload["arrays"])

    def predict(images: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return head(features(run.cfg, images, len(classes))).argmax(1)

    images = trained["target_images"]
    labels = _raw_target(load_config(trained["root"] / "fedvr0.yaml"))[2]
    top = int(predict(images).mode().values)
    keep = sorted({top, (top + 3) % len(classes)})
    chosen = torch.isin(labels, torch.tensor(keep))
    folder = write_png_folder(tmp_path / "some", images[chosen], labels[chosen], classes)
    assert sorted(p.name for p in folder.iterdir()) == [classes[k] for k in keep]

    data = read_images(folder, 16, classes=classes, resize=False, what="image")
    assert data.labels.unique().tolist() == keep
    assert sorted(data.labels.tolist()) == sorted(labels[chosen].tolist())
    predicted = predict(data.images)
    accuracy = float((predicted == data.labels).double().mean())
    by_folder = (data.labels == keep[1]).long()  # the labels a folder-order numbering gives
    assert accuracy > 0 and accuracy != float((predicted == by_folder).double().mean())
    assert main(["evaluate", str(model_file), str(folder)]) == 0
    assert f"({len(data.labels)} images): accuracy {100 * accuracy:.1f}%" in said(capsys)

    shots = read_images(folder, 16, classes=classes, resize=False, what="shots")
    assert torch.equal(shots.labels, data.labels)  # `adapt --shots` reads them alike
