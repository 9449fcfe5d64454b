"""The fields caffe.proto declares for what cnnkit imports, so that a prototxt is read as Caffe
reads it: a field Caffe does not know is an error naming the one meant (Caffe's text parser
refuses it too; a typo such as `stirde` must not import as stride 1), and a declared field
whose value changes the network in a way cnnkit does not follow is refused, not dropped."""

from __future__ import annotations

import difflib
from typing import Any

from cnnkit.errors import ConfigError, brief, suggest
from cnnkit.prototxt import Message

_FILLER = {"type", "value", "min", "max", "mean", "std", "sparse", "variance_norm"}
_ENGINE = {"engine"}

# LayerParameter (and V1LayerParameter for the old `layers { }` syntax); every *_param is a
# layer's parameter block (forks add their own), checked below where cnnkit reads it
LAYER_FIELDS = {"name", "type", "bottom", "top", "phase", "loss_weight", "param", "blobs",
                "propagate_down", "include", "exclude"}  # fmt: skip
V1_LAYER_FIELDS = {"name", "type", "bottom", "top", "include", "exclude", "blobs", "param",
                   "blob_share_mode", "blobs_lr", "weight_decay", "loss_weight", "layer"}  # fmt: skip

PARAM_FIELDS: dict[str, set[str]] = {
    "convolution_param": {"num_output", "bias_term", "pad", "kernel_size", "stride", "dilation",
                          "pad_h", "pad_w", "kernel_h", "kernel_w", "stride_h", "stride_w",
                          "group", "weight_filler", "bias_filler", "engine", "axis",
                          "force_nd_im2col"},
    "inner_product_param": {"num_output", "bias_term", "weight_filler", "bias_filler", "axis",
                            "transpose"},
    "pooling_param": {"pool", "pad", "pad_h", "pad_w", "kernel_size", "kernel_h", "kernel_w",
                      "stride", "stride_h", "stride_w", "engine", "global_pooling",
                      "round_mode", "ceil_mode"},  # ceil_mode: forks' (DenseNet, ResNeXt)
    "lrn_param": {"local_size", "alpha", "beta", "norm_region", "k", "engine"},
    "prelu_param": {"filler", "channel_shared"},
    "relu_param": {"negative_slope", "engine"},
    "elu_param": {"alpha"},
    "swish_param": {"beta"},
    "clip_param": {"min", "max"},
    "tanh_param": _ENGINE,
    "sigmoid_param": _ENGINE,
    "softmax_param": {"engine", "axis"},
    "dropout_param": {"dropout_ratio", "scale_train"},  # scale_train: forks' (BVLC: always)
    "flatten_param": {"axis", "end_axis"},
    "concat_param": {"axis", "concat_dim"},
    "eltwise_param": {"operation", "coeff", "stable_prod_grad"},
    "batch_norm_param": {"use_global_stats", "moving_average_fraction", "eps"},
    "scale_param": {"axis", "num_axes", "filler", "bias_term", "bias_filler"},
    "input_param": {"shape"},
    "reshape_param": {"shape", "axis", "num_axes"},
    "slice_param": {"axis", "slice_point", "slice_dim"},
    "crop_param": {"axis", "offset"},
    "shuffle_channel_param": {"group"},  # the ShuffleNet ports' fork
    "power_param": {"power", "scale", "shift"},
    "bn_param": {"slope_filler", "bias_filler", "momentum", "eps", "frozen", "engine",  # PSPNet's
                 "scale_filler", "shift_filler", "bn_mode", "var_eps", "decay", "moving_average",
                 "axis"},  # (other forks': refused by name, not as misspellings)
    "interp_param": {"height", "width", "zoom_factor", "shrink_factor", "pad_beg", "pad_end"},
}  # fmt: skip
SUB_FIELDS = {"weight_filler": _FILLER, "bias_filler": _FILLER, "filler": _FILLER,
              "slope_filler": _FILLER, "shape": {"dim"}}  # fmt: skip
PARAM_SPEC = {"name", "share_mode", "lr_mult", "decay_mult"}
NET_BLOCKS = {"layer", "layers", "input_shape", "state"}  # NetParameter's fields that are messages
NET_FIELDS = NET_BLOCKS | {"name", "input", "input_dim", "force_backward", "state", "debug_info"}
NET_STATE_FIELDS = {"phase", "level", "stage"}  # NetState: the net's `state { }`
RULE_FIELDS = {"phase", "min_level", "max_level", "stage", "not_stage"}  # include / exclude
# the parameter blocks caffe.proto's LayerParameter declares: a *_param near one of these but
# not it is a typo (`lnr_param`), refused as Caffe refuses it; others are a fork's own
CAFFE_PARAMS = {f"{name}_param" for name in (
    "accuracy", "argmax", "batch_norm", "bias", "clip", "concat", "contrastive_loss",
    "convolution", "crop", "data", "dropout", "dummy_data", "eltwise", "elu", "embed", "exp",
    "flatten", "hdf5_data", "hdf5_output", "hinge_loss", "image_data", "infogain_loss",
    "inner_product", "input", "log", "loss", "lrn", "memory_data", "mvn", "parameter",
    "pooling", "power", "prelu", "python", "recurrent", "reduction", "relu", "reshape", "scale",
    "sigmoid", "slice", "softmax", "spp", "swish", "tanh", "threshold", "tile", "transform",
    "window_data")}  # fmt: skip
LAYER_BLOCKS = {"include", "exclude", "blobs"}  # and LayerParameter's (with *_param, `param`)

# the fields caffe.proto declares `repeated` in the messages checked here: any other given twice
# is refused, as Caffe's text parser refuses it ("Non-repeated field ... specified multiple times")
REPEATED = {
    "NetParameter": {"layer", "layers", "input", "input_dim", "input_shape"},
    "layer": {"bottom", "top", "loss_weight", "param", "blobs", "propagate_down", "include",
              "exclude"},
    "layers": {"bottom", "top", "blobs", "blobs_lr", "weight_decay", "include", "exclude",
               "loss_weight", "param"},
    "convolution_param": {"pad", "kernel_size", "stride", "dilation"},
    "eltwise_param": {"coeff"},
    "slice_param": {"slice_point"},
    "crop_param": {"offset"},
    "input_param": {"shape"},
    "shape": {"dim"},
}  # fmt: skip

# declared fields whose value changes what the layer computes in a way cnnkit does not follow:
# (block, field) -> (the value cnnkit computes with, what the other value would mean)
FOLLOWED: dict[tuple[str, str], tuple[Any, str]] = {
    ("dropout_param", "scale_train"): (
        True, "scale_train: false scales at test time instead; cnnkit's dropout scales in "
        "training, as BVLC Caffe's"),
    ("batch_norm_param", "use_global_stats"): (
        True, "use_global_stats: false normalises with each test batch's own statistics; "
        "cnnkit uses the stored ones"),
    ("softmax_param", "axis"): (1, "a softmax over another axis than the channels"),
}  # fmt: skip


def check_net(source: str, net: Message) -> None:
    """ConfigError for a top-level field NetParameter does not declare (`layr { }`: the layer
    would vanish), and for a value where it declares a block."""
    for name, _, line in net.fields:
        if name not in NET_FIELDS:
            _unknown(f"{source}:{line}", "NetParameter", name, NET_FIELDS)
    expect_blocks(source, net, NET_BLOCKS)
    _once(source, "NetParameter", net)


def _once(source: str, block: str, message: Message) -> None:
    """ConfigError for a field given twice that caffe.proto declares once in `block` (the
    second would silently win here; Caffe's parser refuses it)."""
    seen: set[str] = set()
    repeated = REPEATED.get(block, set())
    for name, _, line in message.fields:
        if name in seen and name not in repeated:
            raise ConfigError(f"{source}:{line}: {name} is given twice in {block} (caffe.proto "
                              "declares it once, and Caffe's parser refuses the second)")  # fmt: skip
        seen.add(name)


def expect_blocks(source: str, message: Message, names: set[str]) -> None:
    """ConfigError for a field of `names` given a value where caffe.proto declares a message
    (`input_shape: 3`, `layer: 3`): one line naming it, not a crash further on."""
    for name, value, line in message.fields:
        if name in names and not isinstance(value, Message):
            raise ConfigError(f"{source}:{line}: {name}: expected a {{ ... }} block, got "
                              f"{brief(value)}")  # fmt: skip


def check_layer(source: str, layer: Message, v1: bool) -> None:
    """ConfigError for a field caffe.proto does not declare in this layer or in one of the
    parameter blocks cnnkit reads, and for a value cnnkit would not compute as Caffe does."""
    known = V1_LAYER_FIELDS if v1 else LAYER_FIELDS
    blocks = {n for n, _, _ in layer.fields if n.endswith("_param")} | LAYER_BLOCKS
    expect_blocks(source, layer, blocks if v1 else blocks | {"param"})  # (V1's param: a name)
    _once(source, "layers" if v1 else "layer", layer)
    for name, value, line in layer.fields:
        if name in PARAM_FIELDS and isinstance(value, Message):
            _check_block(source, name, value)
        elif name.endswith("_param") and name not in CAFFE_PARAMS:
            if difflib.get_close_matches(name, CAFFE_PARAMS, n=1, cutoff=0.8):
                _unknown(f"{source}:{line}", "layer", name, CAFFE_PARAMS)
        elif not (name.endswith("_param") or name in known):
            _unknown(f"{source}:{line}", "layer", name, known)
    for spec in layer.all("param"):
        if isinstance(spec, Message):
            for name, value, line in spec.fields:
                if name not in PARAM_SPEC:
                    _unknown(f"{source}:{line}", "param", name, PARAM_SPEC)
                if name == "name":  # layers sharing one blob (siamese nets): cnnkit's own each
                    raise ConfigError(f"{source}:{line}: param {{ name: {brief(value)} }}: "
                                      "weights shared between layers are not imported")  # fmt: skip
            _once(source, "param", spec)


def _check_block(source: str, block: str, p: Message) -> None:
    allowed = PARAM_FIELDS[block]
    expect_blocks(source, p, set(SUB_FIELDS))
    _once(source, block, p)
    for name, value, line in p.fields:
        if name not in allowed:
            _unknown(f"{source}:{line}", block, name, allowed)
        if name in SUB_FIELDS and isinstance(value, Message):
            _once(source, name, value)
            for sub, _, sub_line in value.fields:
                if sub not in SUB_FIELDS[name]:
                    _unknown(f"{source}:{sub_line}", name, sub, SUB_FIELDS[name])
        follows = FOLLOWED.get((block, name))
        if follows is not None and value != follows[0]:
            shown = str(value).lower() if isinstance(value, bool) else brief(value)
            raise ConfigError(f"{source}:{line}: {block} {{ {name}: {shown} }}: {follows[1]}")


def check_fields(source: str, block: str, message: Message, allowed: set[str]) -> None:
    """ConfigError for a field of `message` that caffe.proto's `block` does not declare."""
    for name, _, line in message.fields:
        if name not in allowed:
            _unknown(f"{source}:{line}", block, name, allowed)


def _unknown(here: str, block: str, name: str, allowed: set[str]) -> None:
    raise ConfigError(f"{here}: {name!r} is not a field of Caffe's {block}"
                      f"{suggest(name, sorted(allowed))}")  # fmt: skip
