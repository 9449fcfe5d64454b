"""Which layers of a Caffe net a deploy import reads, and how they connect: Caffe's
NetStateRule for the deploy state (phase TEST, level 0, the file's own `state` stages), the V1
type names, and
which Scale layers may fold into the BatchNorm before them."""

from __future__ import annotations

from typing import Any

from cnnkit.caffe.fields import enum, integer, require
from cnnkit.caffe.schema import NET_STATE_FIELDS, RULE_FIELDS, check_fields
from cnnkit.errors import brief
from cnnkit.prototxt import Message

V1_TYPES = {  # the old `layers { type: CONVOLUTION }` enum names (V1LayerParameter's, all)
    "ABSVAL": "AbsVal", "ACCURACY": "Accuracy", "ARGMAX": "ArgMax", "BNLL": "BNLL",
    "CONCAT": "Concat", "CONTRASTIVE_LOSS": "ContrastiveLoss", "CONVOLUTION": "Convolution",
    "DATA": "Data", "DECONVOLUTION": "Deconvolution", "DROPOUT": "Dropout",
    "DUMMY_DATA": "DummyData", "EUCLIDEAN_LOSS": "EuclideanLoss", "ELTWISE": "Eltwise",
    "EXP": "Exp", "FLATTEN": "Flatten", "HDF5_DATA": "HDF5Data", "HDF5_OUTPUT": "HDF5Output",
    "HINGE_LOSS": "HingeLoss", "IM2COL": "Im2col", "IMAGE_DATA": "ImageData",
    "INFOGAIN_LOSS": "InfogainLoss", "INNER_PRODUCT": "InnerProduct", "LRN": "LRN",
    "MEMORY_DATA": "MemoryData", "MULTINOMIAL_LOGISTIC_LOSS": "MultinomialLogisticLoss",
    "MVN": "MVN", "POOLING": "Pooling", "POWER": "Power", "RELU": "ReLU", "SIGMOID": "Sigmoid",
    "SIGMOID_CROSS_ENTROPY_LOSS": "SigmoidCrossEntropyLoss", "SILENCE": "Silence",
    "SOFTMAX": "Softmax", "SOFTMAX_LOSS": "SoftmaxWithLoss", "SPLIT": "Split",
    "SLICE": "Slice", "TANH": "TanH", "WINDOW_DATA": "WindowData", "THRESHOLD": "Threshold",
}  # fmt: skip


def layer_type(layer: Message) -> str:
    """A layer's type by its current name (`Convolution` for V1's CONVOLUTION)."""
    kind = str(layer.get("type", ""))
    return V1_TYPES.get(kind, kind)


def deployed_layers(layers: list[Message], source: str, stages: set[str]) -> list[Message]:
    """The layers Caffe builds in the TEST phase at level 0 with `stages` (those of the file's
    `state`, which `caffe.Net(file, caffe.TEST)` keeps): those with an include rule that holds,
    or with no exclude rule that holds (a layer takes one kind of rule, not both)."""
    kept = []
    for layer in layers:
        here = f"{source}:{layer.line}"
        include, exclude = layer.all("include"), layer.all("exclude")
        require(here, not (include and exclude), "give include or exclude rules, not both")
        for rule in include + exclude:
            require(here, isinstance(rule, Message), "include / exclude takes a { ... } rule")
            check_fields(source, "NetStateRule", rule, RULE_FIELDS)
        if include:
            kept += [layer] if any(_meets(here, rule, stages) for rule in include) else []
        else:
            kept += [] if any(_meets(here, rule, stages) for rule in exclude) else [layer]
    return kept


def net_stages(source: str, net: Message) -> set[str]:
    """The stages of the file's `state { stage: ... }`; its phase and level the deploy state
    overrides (TEST, 0), as Caffe's Net(file, phase) does."""
    state = net.get("state")  # a { } block where given (schema.check_net)
    if state is None:
        return set()
    check_fields(source, "NetState", state, NET_STATE_FIELDS)
    return {str(stage) for stage in state.all("stage")}


def _meets(here: str, rule: Any, stages: set[str]) -> bool:
    """Whether a NetStateRule holds for the deploy state, as Caffe's StateMeetsRule: phase TEST,
    level 0 within the rule's bounds, each of its `stage`s held, none of its `not_stage`s."""
    phase = enum(here, rule, "phase", ("TRAIN", "TEST"), "TEST")
    require(here, phase in ("TRAIN", "TEST"), f"phase {brief(phase)}: TRAIN or TEST")
    low, high = integer(here, rule, "min_level", 0), integer(here, rule, "max_level", 0)
    needed, barred = {str(s) for s in rule.all("stage")}, {str(s) for s in rule.all("not_stage")}
    return phase == "TEST" and low <= 0 <= high and needed <= stages and not barred & stages


def sole_readers(layers: list[Message]) -> set[Message]:
    """The Scale layers that alone read their bottom's value (Splits pass it on): only those
    may fold into the BatchNorm before them, as another reader needs the un-scaled value."""
    value: dict[Any, int] = {}  # Caffe blob -> the layer whose output it holds now
    readers: dict[int, int] = {}
    scales = []
    for index, layer in enumerate(layers):
        bottoms = [value.get(b, -1) for b in layer.all("bottom")]
        split = layer_type(layer) == "Split" and len(bottoms) == 1
        for b in [] if split else bottoms:
            readers[b] = readers.get(b, 0) + 1
        if layer_type(layer) == "Scale" and bottoms:
            scales.append((layer, bottoms[0]))
        for top in layer.all("top"):
            value[top] = bottoms[0] if split else index
    return {layer for layer, b in scales if readers[b] == 1}
