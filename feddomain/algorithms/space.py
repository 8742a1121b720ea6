"""Search spaces: the hyper-parameter ranges a method declares next to its hyper-parameters.

``MethodSpec(space={...})`` maps a hyper-parameter of the method to one typed dimension:
``LogUniform`` (a scale: coefficients, step sizes), ``Uniform`` (a share or a mixing weight),
``Int`` and ``Choice``. The ranges come from the method's spec (the §4/§6 grids of
``shared/papers/*.md``: the grid's span becomes the range) or, where a paper gives one value, a
log range of x/10 .. x10 around it clipped to the hyper-parameter's bounds. Only the
hyper-parameters a paper tunes or names as the method's strength are in a space; structural
switches and protocol choices stay at their values. ``feddomain tune`` adds the client learning
rate to every method's space (``LR_FACTOR``).

A space is checked when its method registers (``check_space``): every key is a hyper-parameter
of the method, every bound and option is a value the hyper-parameters' own validation accepts,
and the range covers the method's default, so that tuning can never rule out the setting a
method ships with.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

if TYPE_CHECKING:
    import optuna

    from feddomain.algorithms.base import Hparams

LR_KEY = "train.lr"
LR_FACTOR = 10.0  # the client lr is searched log-uniformly in [lr / 10, lr x 10] of the config's


@dataclass(frozen=True)
class LogUniform:
    """A positive value drawn uniformly in log space between ``low`` and ``high``."""

    low: float
    high: float

    def __post_init__(self) -> None:
        if not 0 < self.low < self.high:
            raise ValueError(f"LogUniform needs 0 < low < high, got {self.low}, {self.high}")

    def bounds(self) -> list[Any]:
        return [self.low, self.high]

    def covers(self, value: Any) -> bool:
        return _number(value) and self.low <= value <= self.high

    def distribution(self) -> optuna.distributions.BaseDistribution:
        from optuna.distributions import FloatDistribution

        return FloatDistribution(self.low, self.high, log=True)

    def describe(self) -> str:
        return f"log-uniform [{self.low:g}, {self.high:g}]"


@dataclass(frozen=True)
class Uniform:
    """A value drawn uniformly between ``low`` and ``high``."""

    low: float
    high: float

    def __post_init__(self) -> None:
        if not self.low < self.high:
            raise ValueError(f"Uniform needs low < high, got {self.low}, {self.high}")

    def bounds(self) -> list[Any]:
        return [self.low, self.high]

    def covers(self, value: Any) -> bool:
        return _number(value) and self.low <= value <= self.high

    def distribution(self) -> optuna.distributions.BaseDistribution:
        from optuna.distributions import FloatDistribution

        return FloatDistribution(self.low, self.high)

    def describe(self) -> str:
        return f"uniform [{self.low:g}, {self.high:g}]"


@dataclass(frozen=True)
class Int:
    """An integer drawn uniformly from ``low`` .. ``high`` (both included)."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not self.low < self.high:
            raise ValueError(f"Int needs low < high, got {self.low}, {self.high}")

    def bounds(self) -> list[Any]:
        return [self.low, self.high]

    def covers(self, value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and (
            self.low <= value <= self.high
        )

    def distribution(self) -> optuna.distributions.BaseDistribution:
        from optuna.distributions import IntDistribution

        return IntDistribution(self.low, self.high)

    def describe(self) -> str:
        return f"int {self.low} .. {self.high}"


@dataclass(frozen=True)
class Choice:
    """One of ``options``, each equally likely."""

    options: tuple[Any, ...]

    def __post_init__(self) -> None:
        if len(self.options) < 2:
            raise ValueError(f"Choice needs at least two options, got {self.options}")

    def bounds(self) -> list[Any]:
        return list(self.options)

    def covers(self, value: Any) -> bool:
        return value in self.options

    def distribution(self) -> optuna.distributions.BaseDistribution:
        from optuna.distributions import CategoricalDistribution

        return CategoricalDistribution(self.options)

    def describe(self) -> str:
        return "one of {" + ", ".join(map(str, self.options)) + "}"


Dimension = LogUniform | Uniform | Int | Choice
Space = Mapping[str, Dimension]


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def lr_dimension(lr: float) -> LogUniform:
    """The client learning rate's range around the config's ``train.lr``."""
    return LogUniform(lr / LR_FACTOR, lr * LR_FACTOR)


def check_space(method: str, hparams: type[Hparams], space: Space) -> None:
    """Refuse a space that names no hyper-parameter of ``hparams``, has a bound or option the
    hyper-parameters reject, or does not cover the default (``ValueError``: a method's
    declaration is wrong, not a user's input)."""
    default = hparams()
    for key, dim in space.items():
        if key not in hparams.model_fields:
            raise ValueError(
                f"method {method!r}: search space key {key!r} is not one of its "
                f"hyper-parameters ({', '.join(hparams.model_fields)})"
            )
        for value in dim.bounds():
            try:
                hparams(**{key: value})
            except ValidationError as err:
                reason = err.errors()[0]["msg"]
                raise ValueError(
                    f"method {method!r}: search space {key} = {dim.describe()} holds {value!r}, "
                    f"which its hyper-parameters refuse ({reason})"
                ) from None
        value = getattr(default, key)
        if not dim.covers(value):
            raise ValueError(
                f"method {method!r}: search space {key} = {dim.describe()} does not cover the "
                f"default {value!r}"
            )
