"""Search spaces declared by the methods (issue 25, item 2): checked at registration, covering
every method's default, FedVR's following fedvr.md §4 as corrected."""

from __future__ import annotations

import pytest

from feddomain.algorithms import METHODS, register
from feddomain.algorithms.base import MethodSpec
from feddomain.algorithms.fedavg import FedAvgServer
from feddomain.algorithms.fedprox import FedProxClient, FedProxHparams
from feddomain.algorithms.fedvr import NoVarHparams
from feddomain.algorithms.space import Choice, Int, LogUniform, Uniform, check_space, lr_dimension
from feddomain.cli import main
from feddomain.errors import ConfigError


def test_every_registered_method_has_a_space_that_covers_its_default():
    """Catches a method whose tuning could never return the setting it ships with (a space
    registered without the check, or a default moved out of its range)."""
    assert len(METHODS) >= 30
    for name, spec in METHODS.items():
        default = spec.hparams()
        for key, dim in spec.space.items():
            assert dim.covers(getattr(default, key)), (name, key)


def test_a_space_that_misses_the_default_is_refused_at_registration():
    """Catches ``register`` accepting a space that excludes the default (FedProx's mu = 0.01
    outside [0.1, 1]): the method is not registered."""
    spec = MethodSpec(
        "fedprox_narrow", FedAvgServer, FedProxClient, FedProxHparams,
        space={"mu": LogUniform(0.1, 1.0)},
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"mu = log-uniform \[0.1, 1\] does not cover the"):
        register(spec)
    assert "fedprox_narrow" not in METHODS


def test_bounds_the_hyper_parameters_refuse_and_unknown_keys_are_refused():
    """Catches a range reaching outside the hyper-parameter's own bounds (a negative mu; a
    FedVR ablation that fixes lambda_var at 0), and a key the method does not have."""
    with pytest.raises(ValueError, match=r"holds -0.1, which its hyper-parameters refuse"):
        check_space("fedprox", FedProxHparams, {"mu": Uniform(-0.1, 0.5)})
    with pytest.raises(ValueError, match=r"lambda_var = .* holds 0.1"):
        check_space("fedvr_no_var", NoVarHparams, {"lambda_var": LogUniform(0.1, 1.0)})
    with pytest.raises(ValueError, match=r"search space key 'nu' is not one of its"):
        check_space("fedprox", FedProxHparams, {"nu": LogUniform(1e-3, 1.0)})


def test_dimensions_cover_exactly_their_ranges():
    """Catches an off-by-one at an end (ends included), a bool taken as an int, and the lr's
    range not being x/10 .. x10 around the config's value."""
    assert LogUniform(1e-3, 1.0).covers(1.0) and not LogUniform(1e-3, 1.0).covers(1.01)
    assert Int(1, 3).covers(3) and not Int(1, 3).covers(4) and not Int(0, 3).covers(True)
    assert Choice(("a", "b")).covers("b") and not Choice(("a", "b")).covers("c")
    lr = lr_dimension(0.003)
    assert (lr.low, lr.high) == pytest.approx((0.0003, 0.03), rel=1e-12)
    with pytest.raises(ValueError, match="0 < low < high"):
        LogUniform(0.0, 1.0)


def test_fedvr_space_is_the_corrected_grid_and_its_ablations_drop_fixed_terms():
    """Catches FedVR's space missing a grid value of fedvr.md §4 (η {3e-2 .. 1}, τ {0.3 .. 10},
    λ_var {0.1, 0.5, 1}), keeping the old η = 1e-2, or an ablation searching the term it
    fixes at 0."""
    space = METHODS["fedvr"].space
    assert set(space) == {"lr_s", "tau", "lambda_var"}
    for key, grid in (("lr_s", (3e-2, 0.1, 0.3, 1.0)), ("tau", (0.3, 1, 3, 10)),
                      ("lambda_var", (0.1, 0.5, 1.0))):  # fmt: skip
        assert all(space[key].covers(v) for v in grid), key
    assert not space["lr_s"].covers(1e-2)
    assert set(METHODS["fedvr_no_var"].space) == {"lr_s", "tau"}
    assert set(METHODS["fedvr_uniform"].space) == {"lr_s", "lambda_var"}
    assert set(METHODS["fedvr_plain"].space) == {"lr_s"}
    assert "ema_alpha" not in METHODS["hfedf_no_ema"].space
    assert "ema_alpha" in METHODS["hfedf"].space


def test_list_methods_spaces_shows_each_method_its_lr_and_its_ranges(capsys):
    """Catches `list methods --spaces` leaving out the lr or a method's own dimensions."""
    assert main(["list", "methods", "--spaces"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert set(lines) == set(METHODS)
    assert "algorithm.mu: log-uniform [0.001, 1]" in lines["fedprox"]
    assert "train.lr: log-uniform [lr/10, lr x10]" in lines["fedavg"]
    assert "algorithm." not in lines["fedavg"]
