"""FedSAM (feddomain/algorithms/fedsam.py): ρ = 0 is FedAvg, one SAM step on a quadratic by hand,
the perturbed pass leaves no trace (BatchNorm statistics, dropout draws), and a negative ρ is
refused. Expected values are written out by hand or come from a FedAvg run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from feddomain.algorithms.fedsam import sam_loss
from feddomain.config import load_config
from feddomain.errors import ConfigError
from feddomain.federation.data import ClientData
from feddomain.federation.simulation import Simulation
from feddomain.federation.training import cross_entropy_loss, train_epochs
from tests.engine_helpers import tiny_config
from tests.test_evidence_engine import uneven_federation


def _run(tmp_path, algorithm) -> Simulation:
    cfg = tiny_config(rounds=2, train__lr=0.1, algorithm=algorithm)
    tmp_path.mkdir(parents=True)
    sim = Simulation(cfg, uneven_federation(cfg), tmp_path)
    sim.run()
    return sim


def test_rho_zero_is_fedavg_bit_for_bit(tmp_path):
    """Catches a perturbation that is not zero at ρ = 0, weights not restored after the
    perturbed pass, a gradient other than the loss's own, or a different reported loss.

    Exact: at ρ = 0 both passes run the same float operations on the same weights and the
    surrogate's gradient is that gradient times 1.0, so every step is FedAvg's."""
    sam = _run(tmp_path / "sam", {"name": "fedsam", "rho": 0.0})
    avg = _run(tmp_path / "avg", "fedavg")
    for k, v in avg.server.global_arrays.items():
        assert torch.equal(sam.server.global_arrays[k], v), k
    strip = lambda rs: [{k: v for k, v in r.items() if k != "time"} for r in rs]  # noqa: E731
    assert strip(sam.records) == strip(avg.records)
    moved = _run(tmp_path / "rho", {"name": "fedsam", "rho": 0.05})
    assert not torch.equal(moved.server.global_arrays["classifier.weight"],
                           avg.server.global_arrays["classifier.weight"])  # fmt: skip


class _Quadratic(nn.Module):
    """L(w) = ½(3 w₁² + 4 w₂²), whatever the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, 1.0], dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _quadratic_loss(model, x, y):
    return 0.5 * (3 * model.w[0] ** 2 + 4 * model.w[1] ** 2)


def test_one_sam_step_on_a_quadratic_matches_the_hand_computation():
    """Catches ε not normalised by the global gradient norm, the step taken at w + ε instead of
    at w, the gradient of w instead of w + ε, or a wrong reported loss.

    By hand, at w = (1, 1): g = (3, 4), ‖g‖ = 5; ρ = 0.5 gives ε = (0.3, 0.4), w + ε =
    (1.3, 1.4), ∇L(w + ε) = (3.9, 5.6); SGD with lr 0.1 from w: (0.61, 0.44). L(w) = 3.5."""
    model = _Quadratic()
    data = ClientData(torch.zeros(1, 1, dtype=torch.float64), torch.zeros(1, dtype=torch.long))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stats = train_epochs(
        model,
        data,
        optimizer,
        epochs=1,
        batch_size=1,
        generator=torch.Generator().manual_seed(0),
        loss_fn=sam_loss(_quadratic_loss, 0.5),
    )
    assert stats.steps == 1
    expected = torch.tensor([0.61, 0.44], dtype=torch.float64)
    torch.testing.assert_close(model.w.detach(), expected, rtol=0, atol=1e-14)
    assert stats.mean_loss == pytest.approx(3.5, abs=1e-14)


class _BnDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


def _train(rho: float | None) -> tuple[_BnDropout, torch.Tensor]:
    """Two epochs of SGD on fixed random data (plain loss if ``rho`` is None); returns the
    model and the global RNG state after training."""
    torch.manual_seed(0)
    model = _BnDropout()
    g = torch.Generator().manual_seed(1)
    data = ClientData(torch.randn(24, 4, generator=g), torch.randint(0, 3, (24,), generator=g))
    loss = cross_entropy_loss if rho is None else sam_loss(cross_entropy_loss, rho)
    torch.manual_seed(2)  # dropout draws come from the global RNG
    train_epochs(
        model,
        data,
        torch.optim.SGD(model.parameters(), lr=0.1),
        epochs=2,
        batch_size=8,
        generator=torch.Generator().manual_seed(3),
        loss_fn=loss,
    )
    return model, torch.get_rng_state()


def test_the_perturbed_pass_leaves_batchnorm_statistics_and_the_rng_stream_alone():
    """Catches BatchNorm running statistics updated twice per batch (once at w + ε), dropout
    draws that differ between the passes or shift the RNG stream, and weights left at w + ε."""
    plain, plain_rng = _train(None)
    zero, zero_rng = _train(0.0)
    sam, sam_rng = _train(0.5)
    # ρ = 0: everything as plain training, bit for bit (parameters, BN buffers, RNG stream)
    for (name, a), b in zip(plain.state_dict().items(), zero.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(plain_rng, zero_rng)
    # ρ > 0: the RNG stream is still FedAvg's and BN statistics are those of the passes at w,
    # so only the first batch's are equal (later batches see different weights)
    assert torch.equal(plain_rng, sam_rng)
    assert not torch.equal(plain.fc1.weight, sam.fc1.weight)
    assert plain.bn.num_batches_tracked == sam.bn.num_batches_tracked == 6  # 2 epochs x 3 batches


def test_batchnorm_statistics_after_one_sam_step_are_those_of_the_pass_at_w():
    """Catches the running statistics of the perturbed pass kept (they would differ from a
    plain forward pass at w on the same batch)."""
    torch.manual_seed(0)
    model = _BnDropout()
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    reference = _BnDropout()
    reference.load_state_dict(model.state_dict())
    reference.train()
    with torch.no_grad():
        reference(x)  # one forward pass at w: the statistics a SAM step must leave
    model.train()
    loss = sam_loss(cross_entropy_loss, 0.5)(model, x, y)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(getattr(model.bn, name), getattr(reference.bn, name)), name
    # the weights are back at w after the perturbed pass (a copy, not w + ε − ε)
    for (name, a), b in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert torch.isfinite(loss) and loss.requires_grad


def test_the_sam_gradient_is_the_gradient_at_the_perturbed_point():
    """Catches a surrogate whose gradient is not ∇L(w + ε) on a real network (float64)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    rho = 0.3
    params = list(model.parameters())
    # the reference: ε = ρ g/‖g‖ and the gradient at w + ε on a separate copy
    copy = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    copy.load_state_dict(model.state_dict())
    g = torch.autograd.grad(F.cross_entropy(copy(x), y), list(copy.parameters()))
    norm = torch.sqrt(sum((t**2).sum() for t in g))
    with torch.no_grad():
        for p, t in zip(copy.parameters(), g, strict=True):
            p.add_(rho * t / norm)
    expected = torch.autograd.grad(F.cross_entropy(copy(x), y), list(copy.parameters()))
    loss = sam_loss(cross_entropy_loss, rho)(model, x, y)
    loss.backward()
    for p, e in zip(params, expected, strict=True):
        torch.testing.assert_close(p.grad, e, rtol=0, atol=1e-14)
    with torch.no_grad():
        assert float(loss) == pytest.approx(float(F.cross_entropy(model(x), y)), abs=1e-15)


def test_a_negative_rho_is_refused_naming_the_key():
    """Catches a negative SAM radius accepted at config time."""
    with pytest.raises(ConfigError, match=r"'algorithm\.rho'"):
        tiny_config(algorithm={"name": "fedsam", "rho": -0.01})


def test_the_baseline_config_uses_sams_standard_radius():
    """Catches the shipped example drifting from ρ = 0.05 or from the pacs-lenet32 profile."""
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs/baselines/fedsam.yaml")
    assert cfg.algorithm.name == "fedsam" and cfg.algorithm.hparams == {"rho": 0.05}
    assert (cfg.train.optimizer, cfg.train.lr) == ("adam", 1e-3)
    assert (cfg.dataset.name, cfg.model.name, cfg.rounds) == ("pacs", "lenet5", 100)
