"""The unseen-domain model of the hypernetwork methods (``ood_model``), shared by hFedF, pFedHN
and FedVR: which model the run-level ood numbers score, each checked against a model built here
by hand from the server's hypernetwork."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from feddomain.federation.training import pack_ensemble, unpack_ensemble
from feddomain.models import build_model
from tests.engine_helpers import run_sim, tiny_config
from tests.test_unseen_domain import acc_and_nll


def _logits(arrays: dict, data) -> torch.Tensor:
    model = build_model("lenet5", 3)
    model.load_state_dict(arrays)
    model.eval()
    with torch.no_grad():
        return model(data.inputs.float() / 255.0).double()


def _run(tmp_path: Path, method: str, choice: str):
    sim = run_sim(tiny_config(rounds=2, algorithm={"name": method, "ood_model": choice}), tmp_path)
    (target,) = sim.data.targets.values()
    models = [sim.server.generated(c) for c in range(3)]
    return sim, target, models


@pytest.mark.parametrize("method", ["hfedf", "pfedhn"])
def test_mean_embedding_scores_the_model_of_the_clients_mean_embedding(method, tmp_path):
    """Catches ood scored with another model than h(mean_i ν_i) (built here from the table)."""
    sim, target, models = _run(tmp_path, method, "mean_embedding")
    with torch.no_grad():
        theta = sim.server.hnet.generate(sim.server.hnet.embeddings.weight.mean(0))
    acc, nll = acc_and_nll({k: v.detach() for k, v in theta.items()}, target)
    record = sim.records[-1]
    assert record["ood_acc"] == pytest.approx(acc, abs=1e-12)
    assert record["ood_nll"] == pytest.approx(nll, rel=1e-5)
    own = [acc_and_nll(m, target)[0] for m in models]
    assert record["client_ood_acc"] == pytest.approx(float(np.mean(own)), abs=1e-12)


def test_parameter_average_scores_the_mean_of_the_generated_models(tmp_path):
    """Catches an average other than the unweighted mean of the clients' generated models."""
    sim, target, models = _run(tmp_path, "hfedf", "parameter_average")
    average = {k: (models[0][k] + models[1][k] + models[2][k]) / 3 for k in models[0]}
    acc, nll = acc_and_nll(average, target)
    assert sim.records[-1]["ood_acc"] == pytest.approx(acc, abs=1e-12)
    assert sim.records[-1]["ood_nll"] == pytest.approx(nll, rel=1e-5)


def test_ensemble_scores_the_mean_predicted_probabilities(tmp_path):
    """Catches an ensemble that averages logits or parameters instead of probabilities, or
    scores one member only."""
    sim, target, models = _run(tmp_path, "hfedf", "ensemble")
    probs = torch.stack([F.softmax(_logits(m, target), 1) for m in models]).mean(0)
    acc = float((probs.argmax(1) == target.labels).double().mean())
    nll = float(-probs[torch.arange(len(target)), target.labels].log().mean())
    record = sim.records[-1]
    assert record["ood_acc"] == pytest.approx(acc, abs=1e-12)
    assert record["ood_nll"] == pytest.approx(nll, rel=1e-5)
    logits_mean = torch.stack([_logits(m, target) for m in models]).mean(0)
    assert not torch.allclose(F.softmax(logits_mean, 1), probs)  # a different model indeed


def test_own_is_the_default_and_scores_each_clients_model(tmp_path):
    """Catches hFedF's default unseen-domain model changed from hfedf.md §2.5 (each client's
    own generated model, ood = their mean)."""
    sim = run_sim(tiny_config(rounds=1, algorithm="hfedf"), tmp_path)
    assert sim.server.hp.ood_model == "own" and sim.server.eval_arrays(None) is None
    record = sim.records[-1]
    assert record["ood_acc"] == pytest.approx(np.mean(record["per_client"]["ood_acc"]), abs=1e-12)


def test_an_ensemble_packs_and_unpacks_in_member_order() -> None:
    """Catches members reordered (ensemble/10 before ensemble/2) or a plain model taken for an
    ensemble."""
    members = [{"w": torch.full((2,), float(k)), "b": torch.tensor([k])} for k in range(12)]
    unpacked = unpack_ensemble(pack_ensemble(members))
    assert unpacked is not None and len(unpacked) == 12
    assert all(
        torch.equal(u["w"], m["w"]) and torch.equal(u["b"], m["b"])
        for u, m in zip(unpacked, members, strict=True)
    )
    assert unpack_ensemble({"w": torch.zeros(1)}) is None


def test_a_bad_ood_model_is_refused_by_name() -> None:
    from feddomain.errors import ConfigError

    with pytest.raises(ConfigError, match="ood_model"):
        tiny_config(algorithm={"name": "hfedf", "ood_model": "zero_shot"})


@pytest.fixture
def flower_task_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a ServerApp process knows about itself (as test_flower.py's ``task_identity``)."""
    from flwr.supercore.task_identity import TaskIdentity

    for attr in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, attr, 1)


@pytest.mark.parametrize("choice", ["ensemble", "parameter_average"])
@pytest.mark.usefixtures("flower_task_identity")
def test_the_unseen_domain_model_on_flower_equals_the_simulator(choice, tmp_path):
    """Catches a packed ensemble (or an averaged model) that the ServerApp/ClientApp path
    scores differently from the simulator (it travels as one model offer to a target node)."""
    from tests.test_flower import assert_same_run, demo_config, deploy_loopback, simulate

    cfg = demo_config("algorithm.name=hfedf", f"algorithm.ood_model={choice}")
    sim = simulate(cfg, tmp_path / "sim")
    deploy_loopback(cfg, tmp_path / "flower")
    assert_same_run(tmp_path / "flower", sim, tmp_path / "sim")
