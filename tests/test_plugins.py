"""Plug-ins: the FedNova example package (examples/feddomain-fednova, docs/plugins.md) loaded
from outside the package, in the simulator and on Flower, and plug-ins that fail, by name."""

from __future__ import annotations

import re
import sys
import textwrap
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import feddomain
from feddomain import plugins
from feddomain.algorithms import METHODS
from feddomain.data.federated import federations
from feddomain.data.sources import DATASETS
from feddomain.federation.messages import Message
from feddomain.federation.simulation import Simulation
from feddomain.models import MODELS
from feddomain.plugins import PluginError

PROJECT = Path(__file__).resolve().parents[1]
EXAMPLE = PROJECT / "examples" / "feddomain-fednova"
DEMO = PROJECT / "configs" / "demo.yaml"
SGD = ["train.optimizer=sgd", "train.lr=0.05", "train.augment.invert_p=0"]
CHEAP = ["split.targets=[grey]", "model.name=lenet5", "model.options={}", "rounds=2", *SGD]


@pytest.fixture
def example(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The example package importable (as after `pip install`), and no FedNova registered
    before the test: each test loads it as a plug-in afresh."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    saved = METHODS.pop("fednova", None)
    monkeypatch.delitem(sys.modules, "feddomain_fednova", raising=False)
    monkeypatch.setattr(plugins, "_imported", set())
    yield
    METHODS.pop("fednova", None)
    if saved is not None:
        METHODS["fednova"] = saved


def simulate(cfg: feddomain.ExperimentConfig, out: Path) -> Simulation:
    (data,) = federations(cfg)
    out.mkdir(parents=True)
    sim = Simulation(cfg, data, out)
    sim.run()
    return sim


def test_the_config_key_loads_the_plugin_and_fednova_reduces_to_fedavg(
    example: None, tmp_path: Path
) -> None:
    """Catches a `plugins:` module not imported before validation, and a FedNova whose
    normalisation does not cancel when every client takes the same number of steps: with one
    batch per epoch (batch size above every client's size; the clients' sizes differ) its model
    is FedAvg's after every round, to float32 rounding."""
    assert "fednova" not in METHODS
    one_batch = [*CHEAP, "train.batch_size=4096", "train.local_epochs=2",
                 "partition.name=dirichlet", "partition.alpha=0.5"]  # fmt: skip
    nova = feddomain.load_config(DEMO, *one_batch, plugins=["feddomain_fednova"],
                                 algorithm="fednova")  # fmt: skip
    assert METHODS["fednova"].server.__module__ == "feddomain_fednova"
    fedavg = feddomain.load_config(DEMO, *one_batch, algorithm="fedavg")
    a, b = simulate(nova, tmp_path / "nova"), simulate(fedavg, tmp_path / "avg")
    sizes = [len(t) for t in a.data.train]
    assert len(set(sizes)) > 1, sizes  # unequal clients: the weights p_i matter
    for name, w in a.server.global_arrays.items():
        torch.testing.assert_close(w, b.server.global_arrays[name], rtol=0, atol=2e-6)
    assert [r["ood_acc"] for r in a.records] == [r["ood_acc"] for r in b.records]


def test_the_tutorial_shows_the_example_packages_code() -> None:
    """Catches docs/plugins.md drifting from the example package it walks through: its Python
    and pyproject blocks are the package's files, verbatim."""
    doc = (PROJECT / "docs" / "plugins.md").read_text()
    blocks = re.findall(r"```(?:python|toml)\n(.*?)```", doc, flags=re.S)
    assert (EXAMPLE / "feddomain_fednova" / "__init__.py").read_text() in blocks
    assert (EXAMPLE / "pyproject.toml").read_text() in blocks


def test_fednova_aggregates_normalised_updates_as_computed_by_hand(example: None) -> None:
    """Catches a server step other than w − η_g·τ_eff·Σ p_i d_i: two clients of 1 and 3
    samples with 2 and 6 steps from w = 1 (p = 1/4, 3/4; τ_eff = 5)."""
    import feddomain_fednova as nova

    server = nova.FedNovaServer.__new__(nova.FedNovaServer)
    server.hp = nova.FedNovaHparams(server_lr=0.5)
    server.global_arrays = {"w": torch.tensor([1.0, 1.0], dtype=torch.float64)}
    replies = [
        (0, Message("fit", {"w": torch.tensor([0.2, -0.4], dtype=torch.float64)},
                    {"num_examples": 1, "steps": 2})),
        (1, Message("fit", {"w": torch.tensor([0.04, 0.0], dtype=torch.float64)},
                    {"num_examples": 3, "steps": 6})),
    ]  # fmt: skip
    server.aggregate(1, iter(replies))
    # Σ p_i d_i = (0.2/4 + 0.12/4, -0.4/4) = (0.08, -0.1); w − 0.5·5·that = (0.8, 1.25)
    torch.testing.assert_close(
        server.global_arrays["w"], torch.tensor([0.8, 1.25], dtype=torch.float64)
    )


def test_an_installed_entry_point_registers_the_method_without_a_config_key(
    example: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches entry points of the group feddomain.methods not being loaded (or the example's
    pyproject declaring a wrong one): a distribution's metadata as `pip install` writes it,
    from the example's own pyproject, makes `algorithm: fednova` valid in any config."""
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    info = tmp_path / "site" / "feddomain_fednova-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\n"
                                   "Version: 0.1.0\n")  # fmt: skip
    lines = [f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in points.items())
             for group, points in project["entry-points"].items()]  # fmt: skip
    (info / "entry_points.txt").write_text("\n".join(lines))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(plugins, "_entry_points_loaded", False)
    cfg = feddomain.load_config(DEMO, *CHEAP, algorithm="fednova")
    assert cfg.algorithm.name == "fednova" and "fednova" in METHODS


def test_fednova_as_a_plugin_on_flower_equals_the_simulator(
    example: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches a plug-in method that cannot be deployed: the Flower ServerApp and ClientApps
    (each validating the config it receives, so importing the plug-in) run FedNova with the
    same server state, records and summary as the simulator."""
    from flwr.supercore.task_identity import TaskIdentity

    from tests.test_flower import BASE, assert_same_run, deploy_loopback

    for attr in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, attr, 1)
    cfg = feddomain.load_config(DEMO, *BASE, *SGD, plugins=["feddomain_fednova"],
                                algorithm="fednova")  # fmt: skip
    sim = simulate(cfg, tmp_path / "sim")
    deploy_loopback(cfg, tmp_path / "flower")
    assert (tmp_path / "flower" / "summary.json").is_file()
    assert_same_run(tmp_path / "flower", sim, tmp_path / "sim")


# ------------------------------------------------------------------ plug-ins that fail
def write_plugin(folder: Path, name: str, body: str) -> None:
    (folder / f"{name}.py").write_text(textwrap.dedent(body))


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(plugins, "_imported", set())
    return tmp_path


HEADER = """
from pydantic import Field
import feddomain
from feddomain.algorithms.fedavg import FedAvgClient, FedAvgHparams, FedAvgServer
"""


def test_a_plugin_that_fails_to_import_is_named(plugin_dir: Path) -> None:
    """Catches an import failure surfacing as a bare traceback (or not at all): the message
    names the module, the config key and the error."""
    write_plugin(plugin_dir, "broken_plugin", "import no_such_dependency_xyz\n")
    expected = (
        r"plugin 'broken_plugin' \('plugins' in defaults and the arguments of load_config\) "
        r"failed to import: ModuleNotFoundError.*no_such_dependency_xyz"
    )
    with pytest.raises(PluginError, match=expected):
        feddomain.load_config(None, plugins=["broken_plugin"])
    with pytest.raises(PluginError, match=r"plugin 'not_there_xyz'.*installed"):
        feddomain.load_config(None, plugins=["not_there_xyz"])


def test_a_plugin_registering_a_taken_name_is_refused_by_name(plugin_dir: Path) -> None:
    """Catches a plug-in silently replacing a built-in method (or model, or dataset)."""
    write_plugin(plugin_dir, "taken_plugin", HEADER + """
feddomain.register(feddomain.MethodSpec("fedavg", FedAvgServer, FedAvgClient, FedAvgHparams))
""")  # fmt: skip
    with pytest.raises(PluginError, match=r"plugin 'taken_plugin'.*method 'fedavg' is already "
                       r"registered \(by feddomain\.algorithms\.fedavg\)"):  # fmt: skip
        feddomain.load_config(None, plugins=["taken_plugin"])
    assert METHODS["fedavg"].server.__module__ == "feddomain.algorithms.fedavg"
    with pytest.raises(feddomain.ConfigError, match="model 'lenet5' is already registered"):
        feddomain.register_model("lenet5", MODELS["small_cnn"])
    with pytest.raises(feddomain.ConfigError, match="dataset 'pacs' is already registered"):
        feddomain.register_dataset(feddomain.DatasetSpec("pacs", "x", None, None))
    assert DATASETS["PACS"].folder == "PACS"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("class Hp(feddomain.Hparams):\n    mu: float = Field(-1.0, ge=0.0)\n",
         r"its hyper-parameters Hp need valid defaults: mu \(Input should be greater than or "
         r"equal to 0"),
        ("class Hp(feddomain.Hparams):\n    mu: float\n",
         r"need valid defaults: mu \(Field required\)"),
        ("from pydantic import BaseModel\nclass Hp(BaseModel):\n    mu: float = 0.1\n",
         r"hparams must be a subclass of feddomain's Hparams"),
    ],
    ids=["default-out-of-range", "no-default", "not-hparams"],
)
def test_a_plugin_with_a_bad_hyperparameter_model_is_refused_by_name(
    plugin_dir: Path, body: str, message: str
) -> None:
    """Catches a method whose hyper-parameters could not be validated (a default its own
    constraint refuses, no default, a model that accepts unknown keys) being registered."""
    write_plugin(plugin_dir, "bad_hp", HEADER + body + """
feddomain.register(feddomain.MethodSpec("bad_hp", FedAvgServer, FedAvgClient, Hp))
""")  # fmt: skip
    prefix = (
        r"plugin 'bad_hp' \('plugins' in defaults and the arguments of load_config\): "
        r"method 'bad_hp' cannot be registered: "
    )
    with pytest.raises(PluginError, match=prefix + r".*" + message):
        feddomain.load_config(None, plugins=["bad_hp"])
    assert "bad_hp" not in METHODS


def test_a_plugin_without_a_privacy_declaration_is_refused_by_name(plugin_dir: Path) -> None:
    """Catches a client part that declares nothing it uploads (no ``uploads``) being
    registered, to fail only at its first reply."""
    write_plugin(plugin_dir, "no_uploads", HEADER + """
from feddomain.algorithms.base import ClientAlgorithm
class Client(ClientAlgorithm):
    def run(self, msg, ctx):
        return msg
feddomain.register(feddomain.MethodSpec("no_uploads", FedAvgServer, Client, FedAvgHparams))
""")  # fmt: skip
    expected = "client Client does not implement uploads (uploads: the privacy declaration)"
    with pytest.raises(PluginError, match=re.escape(expected)):
        feddomain.load_config(None, plugins=["no_uploads"])


def test_an_entry_point_that_fails_names_itself_and_its_distribution(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches a broken installed plug-in failing without its name (or being skipped)."""
    info = tmp_path / "broken_dist-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-dist\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[feddomain.models]\nmynet = no_such_module_xyz:net\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(plugins, "_entry_points_loaded", False)
    expected = (
        r"plugin entry point mynet = 'no_such_module_xyz:net' \(group feddomain\.models, "
        r"distribution broken-dist\) failed to import"
    )
    with pytest.raises(PluginError, match=expected):
        feddomain.load_config(None)


TINY_PLUGIN = """
import torch
from torch import nn
from feddomain import DatasetSpec
from feddomain.data.dataset import DomainDataset
from feddomain.models.base import FeatureClassifier


def tiny_net(num_classes, *, resolution=32, width=4):
    \"\"\"A plug-in's model: one convolution, global pooling, a linear head.\"\"\"
    features = nn.Sequential(nn.Conv2d(3, width, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                             nn.Flatten())
    return FeatureClassifier(features, nn.Linear(width, num_classes), width)


def _stripes(resolution, seed, cache_dir):
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(120) % 2
    domains = torch.arange(120) // 40
    images = torch.randint(0, 100, (120, 3, resolution, resolution), generator=g)
    images[labels == 1, :, :, ::2] += 120  # class 1: vertical stripes
    return DomainDataset("stripes", ("a", "b", "c"), ("plain", "striped"),
                         images.to(torch.uint8), labels, domains)


STRIPES = DatasetSpec("stripes", None, None, None, builtin=_stripes)
"""


def test_a_dataset_and_a_model_from_entry_points_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches the dataset and model groups not registering what their entry points name (a
    DatasetSpec object; a builder, under the entry point's name) or a run not reaching them."""
    (tmp_path / "tiny_plugin.py").write_text(TINY_PLUGIN)
    info = tmp_path / "tiny_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tiny-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[feddomain.datasets]\nstripes = tiny_plugin:STRIPES\n\n"
        "[feddomain.models]\ntiny_net = tiny_plugin:tiny_net\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(plugins, "_entry_points_loaded", False)
    try:
        cfg = feddomain.load_config(
            None, "rounds=1", "split.targets=[c]", "partition.n_clients=2",
            dataset={"name": "stripes"}, model={"name": "tiny_net", "options": {"width": 2}},
        )  # fmt: skip
        (run,) = feddomain.run(cfg, out=tmp_path / "run", quiet=True)
        assert run.summary["dataset"] == "stripes" and run.summary["target_domains"] == ["c"]
        assert MODELS["tiny_net"].__module__ == "tiny_plugin"
    finally:
        DATASETS.pop("stripes", None)
        MODELS.pop("tiny_net", None)
