"""Permutation specs: which tensor axes a channel permutation of each feature map acts on.

A model's conv filters can be reordered without changing its function only if every tensor that
reads or normalises those channels is reordered with them (hfedatm.md §3.4.4, Git-Re-Basin
style). A ``PermutationSpec`` lists, per architecture:

* ``groups``, in solve order: one permutation each, acting on axis 0 of its convs' weights and
  biases and of its BatchNorm's affine parameters and running statistics. Residual additions
  force one group over several convs (ResNet's ``res0`` .. ``res3``);
* ``consumers``: every layer input that reads channels of groups — axis 1 of a conv, or the
  columns of a Linear after a flatten (``positions`` = spatial positions per channel, channel
  major, PyTorch's flatten) whose Gram follows the same index (``dense``). An input may be a
  concatenation of several groups (hFedF's Inception blocks pass their input through).

Convention (hfedatm.md §3.0): a permutation ``perm`` of a group aligns a model to a reference
by ``aligned = target[perm]``; ``perm[a]`` is the target's channel matched to reference channel a.

Specs exist for LeNet-5, VGG-11, ResNet-18, the hFedF CNN and small_cnn (BatchNorm or no norm),
and, on request, for the feed-forward neurons of transformer blocks (``transformer_ffn_spec``).
A model with convolutions and no spec is refused by name (never silently misaligned); a model
without convolutions (a head on cached features) has an empty spec: nothing to align.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from feddomain.errors import ConfigError

Arrays = dict[str, Tensor]


@dataclass(frozen=True)
class Group:
    """One channel permutation: ``filters`` (conv weights, the cost's members), their
    ``biases`` and the ``norms``' tensors (BatchNorm weight, bias, running mean and var)."""

    name: str
    size: int
    filters: tuple[str, ...]
    biases: tuple[str, ...] = ()
    norms: tuple[str, ...] = ()


@dataclass(frozen=True)
class Consumer:
    """An input axis reading the channels of ``layout`` (group names, concatenated in order),
    each repeated over ``positions`` flattened spatial positions. ``dense``: ``tensor`` is a
    Linear's weight whose input Gram (named by ``module``) follows the permutation."""

    tensor: str
    layout: tuple[str, ...]
    positions: int = 1
    module: str = ""
    dense: bool = False


@dataclass(frozen=True)
class PermutationSpec:
    arch: str
    groups: tuple[Group, ...]  # solve order
    consumers: tuple[Consumer, ...]

    def group(self, name: str) -> Group:
        return next(g for g in self.groups if g.name == name)

    def consumer_of(self, tensor: str) -> Consumer | None:
        """The input side of ``tensor`` (None: it reads the raw image)."""
        return next((c for c in self.consumers if c.tensor == tensor), None)

    def input_index(self, consumer: Consumer, perms: Mapping[str, Tensor]) -> Tensor:
        """Index along ``consumer``'s input axis that applies ``perms`` (identity for a group
        without one): per group segment offset + perm, each channel expanded blockwise over its
        ``positions`` (new column c*P + p reads old column perm[c]*P + p)."""
        parts, offset = [], 0
        for name in consumer.layout:
            size = self.group(name).size
            perm = perms.get(name, torch.arange(size))
            parts.append(offset + perm)
            offset += size
        channels = torch.cat(parts)
        p = consumer.positions
        return (channels.view(-1, 1) * p + torch.arange(p).view(1, -1)).reshape(-1)


def apply_permutations(
    spec: PermutationSpec,
    arrays: Mapping[str, Tensor],
    grams: Mapping[str, Tensor],
    perms: Mapping[str, Tensor],
) -> tuple[Arrays, dict[str, Tensor]]:
    """``arrays`` and dense-layer ``grams`` (by module name; [d, d] or a [d] diagonal) with every
    group's permutation applied on both sides (graph mode): the model computes the same
    function, with its channels reordered."""
    out, grams_out = dict(arrays), dict(grams)
    for group in spec.groups:
        perm = perms.get(group.name)
        if perm is None:
            continue
        for name in (*group.filters, *group.biases, *group.norms):
            out[name] = out[name].index_select(0, perm)
    for consumer in spec.consumers:
        if not any(name in perms for name in consumer.layout):
            continue
        index = spec.input_index(consumer, perms)
        out[consumer.tensor] = out[consumer.tensor].index_select(1, index)
        gram = grams_out.get(consumer.module) if consumer.dense else None
        if gram is not None:
            gram = gram.index_select(0, index)
            grams_out[consumer.module] = gram.index_select(1, index) if gram.dim() == 2 else gram
    return out, grams_out


def check_spec(spec: PermutationSpec, arrays: Mapping[str, Tensor]) -> None:
    """Every tensor the spec names exists with the sizes it states; raises naming the first
    mismatch (a spec out of step with its model would misalign silently)."""
    for group in spec.groups:
        for name in (*group.filters, *group.biases, *group.norms):
            if name not in arrays:
                raise ConfigError(f"permutation spec {spec.arch}: no tensor {name!r} in the model")
            if arrays[name].shape[0] != group.size:
                raise ConfigError(
                    f"permutation spec {spec.arch}: {name} has {arrays[name].shape[0]} "
                    f"channels, group {group.name} has {group.size}"
                )
    for consumer in spec.consumers:
        width = sum(spec.group(g).size for g in consumer.layout) * consumer.positions
        tensor = arrays.get(consumer.tensor)
        if tensor is None or tensor.shape[1] != width:
            found = None if tensor is None else list(tensor.shape)
            raise ConfigError(
                f"permutation spec {spec.arch}: {consumer.tensor} should read {width} inputs "
                f"(found {found})"
            )


# ---------------------------------------------------------------- specs by architecture
def _conv(model: nn.Module, name: str) -> nn.Conv2d:
    conv = model.get_submodule(name)
    if not isinstance(conv, nn.Conv2d) or conv.groups != 1:
        raise ConfigError(f"permutation spec: {name} is not a plain (ungrouped) Conv2d")
    return conv


def _group(model: nn.Module, name: str, convs: Sequence[str], norms: Sequence[str] = ()) -> Group:
    """A group over ``convs`` (same output width) and their ``norms`` (BatchNorm, or Identity
    for none; GroupNorm is refused: moving channels across its groups changes the function)."""
    size = _conv(model, convs[0]).out_channels
    biases = tuple(f"{c}.bias" for c in convs if _conv(model, c).bias is not None)
    norm_tensors: list[str] = []
    for n in norms:
        module = model.get_submodule(n)
        if isinstance(module, nn.Identity):
            continue
        if not isinstance(module, nn.BatchNorm2d):
            raise ConfigError(
                f"permutation spec: {n} is a {type(module).__name__}; only BatchNorm2d (or no "
                "norm) can follow a permuted conv"
            )
        keys = ("weight", "bias", "running_mean", "running_var")
        norm_tensors += [f"{n}.{k}" for k in keys if getattr(module, k, None) is not None]
    return Group(name, size, tuple(f"{c}.weight" for c in convs), biases, tuple(norm_tensors))


def _dense(model: nn.Module, module: str, layout: Sequence[str], channels: int) -> Consumer:
    """A Linear reading the flattened channels of ``layout`` (``channels`` in all)."""
    linear = model.get_submodule(module)
    if not isinstance(linear, nn.Linear) or linear.in_features % channels:
        raise ConfigError(
            f"permutation spec: {module} must be a Linear reading {channels} channels times "
            "their spatial positions"
        )
    positions = linear.in_features // channels
    return Consumer(f"{module}.weight", tuple(layout), positions, module, dense=True)


def _head(model: nn.Module) -> str:
    """The dense layer reading the featurizer's output: FedSR's (μ, σ) layer, else the
    classifier."""
    if isinstance(getattr(model, "map_layer", None), nn.Linear):
        return "map_layer"
    if isinstance(getattr(model, "classifier", None), nn.Linear):
        return "classifier"
    raise ConfigError(f"permutation spec: {type(model).__name__} has no Linear after its features")


def _chain(model: nn.Module, arch: str, blocks: Sequence[tuple[str, str | None]], head: str):
    """A plain chain of (conv, norm) blocks, each read by the next, the last by ``head``."""
    groups = [_group(model, conv, [conv], [norm] if norm else []) for conv, norm in blocks]
    consumers = [
        Consumer(f"{conv}.weight", (prev.name,))
        for (conv, _), prev in zip(blocks[1:], groups, strict=False)
    ]
    consumers.append(_dense(model, head, [groups[-1].name], groups[-1].size))
    return PermutationSpec(arch, tuple(groups), tuple(consumers))


def lenet5_spec(model: nn.Module) -> PermutationSpec:
    """conv1 (-> bn1) -> conv2 (-> bn2) -> flatten (16 x 5 x 5 at 32 px) -> fc1."""
    f = model.featurizer
    blocks = [
        (f"featurizer.conv{i}", f"featurizer.bn{i}" if hasattr(f, f"bn{i}") else None)
        for i in (1, 2)
    ]
    return _chain(model, "lenet5", blocks, "featurizer.fc1")


def small_cnn_spec(model: nn.Module) -> PermutationSpec:
    """conv-norm blocks, global average pool, then the head (P = 1)."""
    blocks = [
        (f"featurizer.{name}.0", f"featurizer.{name}.1")
        for name, block in model.featurizer.named_children()
        if isinstance(block, nn.Sequential)
    ]
    return _chain(model, "small_cnn", blocks, _head(model))


def vgg11_spec(model: nn.Module) -> PermutationSpec:
    """Eight convs in a chain; the last one's 7x7 pooled maps feed classifier.0 (P = 49)."""
    features = model.featurizer.features
    blocks = [
        (f"featurizer.features.{name}", None)
        for name, m in features.named_children()
        if isinstance(m, nn.Conv2d)
    ]
    return _chain(model, "vgg11", blocks, "featurizer.classifier.0")


def hfedf_cnn_spec(model: nn.Module) -> PermutationSpec:
    """conv1 -> conv2 -> conv3 -> two Inception blocks. Each block's three branch convs read the
    whole input and its output is [branch1, branch3, branch5, input] (the max-pooled input
    passes through), so the layouts grow; fc reads the last layout over 3 x 3 positions."""
    f = "featurizer"
    groups = [_group(model, f"{f}.conv{i}", [f"{f}.conv{i}"]) for i in (1, 2, 3)]
    consumers = [
        Consumer(f"{f}.conv2.weight", ("featurizer.conv1",)),
        Consumer(f"{f}.conv3.weight", ("featurizer.conv2",)),
    ]
    layout: tuple[str, ...] = (f"{f}.conv3",)
    for block in ("inception1", "inception2"):
        branches = [f"{f}.{block}.branch{k}" for k in (1, 3, 5)]
        groups += [_group(model, b, [b]) for b in branches]
        consumers += [Consumer(f"{b}.weight", layout) for b in branches]
        layout = (*branches, *layout)
    channels = sum(g.size for g in groups if g.name in layout)
    consumers.append(_dense(model, f"{f}.fc", layout, channels))
    return PermutationSpec("hfedf_cnn", tuple(groups), tuple(consumers))


def resnet_spec(model: nn.Module) -> PermutationSpec:
    """ResNet with BasicBlocks (ResNet-18). Residual additions tie the stem and every block
    output of a stage to one group (``res0`` .. ``res3``; a block with a downsample starts the
    next), and each block's conv1/bn1 is its own group (``<block>.inner``). Solve order (§3.4.4):
    res0 (stem), then per block its inner group, and a new residual group right after the inner
    group of the block that opens it (its conv2 and downsample inputs are solved by then)."""
    from torchvision.models.resnet import BasicBlock  # late: seconds of start-up (SymPy)

    f = "featurizer"
    order = ["res0"]
    members: dict[str, tuple[list[str], list[str]]] = {"res0": ([f"{f}.conv1"], [f"{f}.bn1"])}
    consumers: list[Consumer] = []
    stream = "res0"  # the residual group the running feature map belongs to
    for layer in ("layer1", "layer2", "layer3", "layer4"):
        for index, block in enumerate(model.get_submodule(f"{f}.{layer}")):
            if not isinstance(block, BasicBlock):
                raise ConfigError("permutation spec resnet: only BasicBlock ResNets (ResNet-18)")
            b = f"{f}.{layer}.{index}"
            inner = f"{b}.inner"
            members[inner] = ([f"{b}.conv1"], [f"{b}.bn1"])
            order.append(inner)
            consumers.append(Consumer(f"{b}.conv1.weight", (stream,)))
            consumers.append(Consumer(f"{b}.conv2.weight", (inner,)))
            if block.downsample is not None:
                consumers.append(Consumer(f"{b}.downsample.0.weight", (stream,)))
                stream = f"res{len([g for g in order if g.startswith('res')])}"
                order.append(stream)
                members[stream] = ([f"{b}.downsample.0"], [f"{b}.downsample.1"])
            convs, norms = members[stream]
            convs.append(f"{b}.conv2")
            norms.append(f"{b}.bn2")
    groups = [_group(model, name, *members[name]) for name in order]
    size = groups[order.index(stream)].size
    consumers.append(_dense(model, _head(model), [stream], size))
    return PermutationSpec("resnet18", tuple(groups), tuple(consumers))


def transformer_ffn_spec(model: nn.Module) -> PermutationSpec:
    """Each transformer block's feed-forward hidden neurons as a group (HFedATM's optional
    ``fot_transformer_ffn``, not in the paper): the rows and bias of ``<block>.intermediate.dense``
    are its filters, the columns of ``<block>.output.dense`` (and its Gram) read them. The
    residual stream is never permuted, so every block aligns on its own and the model's function
    is unchanged. BERT, RoBERTa and DeBERTa name their blocks' layers so."""
    groups, consumers = [], []
    for name, module in model.named_modules():
        if not (name.endswith(".intermediate.dense") and isinstance(module, nn.Linear)):
            continue
        block = name.removesuffix(".intermediate.dense")
        reader = model.get_submodule(f"{block}.output.dense")
        if not isinstance(reader, nn.Linear) or reader.in_features != module.out_features:
            raise ConfigError(f"permutation spec: {block}.output.dense does not read {name}")
        bias = (f"{name}.bias",) if module.bias is not None else ()
        groups.append(Group(f"{block}.ffn", module.out_features, (f"{name}.weight",), bias))
        reads = f"{block}.output.dense"
        consumers.append(Consumer(f"{reads}.weight", (groups[-1].name,), 1, reads, dense=True))
    if not groups:
        arch = getattr(model, "arch", "") or type(model).__name__
        raise ConfigError(
            f"hfedatm: fot_transformer_ffn needs transformer blocks (<block>.intermediate.dense "
            f"and <block>.output.dense); model {arch!r} has none"
        )
    return PermutationSpec(f"{getattr(model, 'arch', '')}-ffn", tuple(groups), tuple(consumers))


SPECS: dict[str, Callable[[nn.Module], PermutationSpec]] = {
    "lenet5": lenet5_spec,
    "small_cnn": small_cnn_spec,
    "vgg11": vgg11_spec,
    "hfedf_cnn": hfedf_cnn_spec,
    "resnet18": resnet_spec,
}


def permutation_spec(model: nn.Module) -> PermutationSpec:
    """The spec of ``model`` (by its ``arch``); empty for a model without convolutions. Raises
    ``ConfigError`` naming the model when it has convolutions and no spec, or convolutions the
    spec does not cover."""
    convs = {name for name, m in model.named_modules() if isinstance(m, nn.Conv2d)}
    if not convs:
        return PermutationSpec(getattr(model, "arch", "") or type(model).__name__, (), ())
    arch = getattr(model, "arch", "")
    if arch not in SPECS:
        raise ConfigError(
            f"hfedatm: model {arch or type(model).__name__!r} has no permutation spec, so its "
            f"filters cannot be aligned function-preservingly (specs: {sorted(SPECS)}); "
            "set algorithm.fot: false to merge without alignment"
        )
    spec = SPECS[arch](model)
    norms = {n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    covered = {t.rsplit(".", 1)[0] for g in spec.groups for t in (*g.filters, *g.norms)}
    if not covered >= convs | norms:
        raise ConfigError(
            f"hfedatm: the permutation spec of {arch} does not cover the layers "
            f"{sorted((convs | norms) - covered)} of this model"
        )
    return spec
