"""``train.precise_bn``: BatchNorm running statistics re-estimated with a client's final weights.

Why it exists: on ``small_cnn`` trained with the profile's Adam, the running averages kept during
training lag the moving weights and a client's id accuracy swings by 30 points between rounds
(docs/results-smoke.md, issue 11); statistics recomputed with the final weights do not.
"""

from __future__ import annotations

import torch
from torch import nn

from feddomain.federation.data import ClientData
from feddomain.federation.training import model_arrays, recalibrate_batchnorm, set_arrays
from feddomain.models import build_model
from tests.engine_helpers import run_sim, tiny_config, tiny_federation


def test_statistics_are_the_mean_over_batches_of_each_batch_s_mean_and_variance():
    """Hand values in float64 over unequal batches (4, 4, 2). Catches: the old running stats
    left in (no reset), the EMA momentum kept instead of an equal-weight mean, biased batch
    variances, the last partial batch left out, the layer's mode or momentum not restored."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(10, 2, 3, 3, generator=g, dtype=torch.float64) * torch.tensor(
        [1.0, 4.0], dtype=torch.float64
    ).view(1, 2, 1, 1)
    data = ClientData(x, torch.zeros(10, dtype=torch.long))
    bn = nn.BatchNorm2d(2).double()
    bn.running_mean.fill_(7.0)
    bn.running_var.fill_(9.0)
    bn.eval()

    recalibrate_batchnorm(bn, data, 4, torch.Generator().manual_seed(5))

    order = torch.randperm(10, generator=torch.Generator().manual_seed(5))
    batches = [x[order[i : i + 4]] for i in range(0, 10, 4)]
    assert [len(b) for b in batches] == [4, 4, 2]
    means = [b.transpose(0, 1).reshape(2, -1).mean(1) for b in batches]
    variances = [b.transpose(0, 1).reshape(2, -1).var(1, unbiased=True) for b in batches]
    torch.testing.assert_close(bn.running_mean, sum(means) / 3, rtol=0, atol=1e-12)
    torch.testing.assert_close(bn.running_var, sum(variances) / 3, rtol=0, atol=1e-12)
    assert not bn.training and bn.momentum == 0.1


def _first_bn_input_stats(arrays: dict, data: ClientData) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased variance of the first BatchNorm's input over all of ``data``, float64."""
    model = build_model("small_cnn", 3).double()
    set_arrays(model, {k: v.double() if v.is_floating_point() else v for k, v in arrays.items()})
    x = torch.cat([b for b, _ in data.batches(len(data), shuffle=False)]).double()
    conv = model.featurizer[0][0]
    with torch.no_grad():
        h = conv(x).transpose(0, 1).reshape(conv.out_channels, -1)
    return h.mean(1), h.var(1, unbiased=True)


def test_a_client_keeps_the_statistics_of_its_final_weights_only_when_asked(tmp_path):
    """Local-only on small_cnn, one batch per epoch (batch = the client's data), so the precise
    statistics are exactly the first BN input's statistics over the client's data under the
    weights it ended with. Catches: the flag not reaching the client context, recalibration
    skipped, or done before the last step (stale weights); and, when off, the flag applied anyway.
    """
    stats = {}
    for precise in (True, False):
        cfg = tiny_config(
            algorithm={"name": "local"},
            model={"name": "small_cnn"},
            train={"batch_size": 36, "lr": 0.05, "optimizer": "sgd", "precise_bn": precise},
            rounds=2,
        )
        fed = tiny_federation(cfg)
        assert [len(t) for t in fed.train] == [36, 36, 36]
        sim = run_sim(cfg, tmp_path / str(precise), fed)
        arrays = model_arrays(sim.states[0])
        want_mean, want_var = _first_bn_input_stats(arrays, fed.train[0])
        got_mean = arrays["featurizer.0.1.running_mean"].double()
        got_var = arrays["featurizer.0.1.running_var"].double()
        stats[precise] = (
            (got_mean - want_mean).abs().max() / want_mean.abs().max(),
            (got_var - want_var).abs().max() / want_var.abs().max(),
        )
    # float32 forward of 36 x 32 x 32 values per channel: relative error ~1e-6
    assert max(stats[True]) < 1e-4, stats[True]
    assert min(stats[False]) > 1e-2, stats[False]
