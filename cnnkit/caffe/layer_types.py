"""One handler per Caffe layer type cnnkit imports (`LayerTypes`, the Translator's base): the
layer's params read with Caffe's defaults and semantics into a cnnkit layer spec, emitted."""

from __future__ import annotations

from typing import Any

from cnnkit.caffe.deploy import layer_type
from cnnkit.caffe.fields import (
    enum,
    fillers,
    flag,
    integer,
    learning,
    multipliers,
    put,
    real,
    require,
    sizes,
)
from cnnkit.caffe.layer_shapes import ShapeTypes
from cnnkit.errors import brief
from cnnkit.nn.layers import fmt_shape
from cnnkit.prototxt import Message


class LayerTypes(ShapeTypes):
    """The `_<type>` handlers the Translator dispatches to, by the Caffe type in lower case;
    each reads the layer's params and emits its cnnkit layer (or aliases its blobs). Those
    that reshape, join or split blobs are ShapeTypes' (caffe/layer_shapes.py)."""

    def _convolution(self, layer: Message, last: bool, kind: str = "conv",
                     groups: int | None = None, out_channels: int | None = None) -> None:  # fmt: skip
        p, here = layer.sub("convolution_param"), self.here
        what = "Convolution" if kind == "conv" else "Deconvolution"
        require(here, integer(here, p, "axis", 1) == 1, f"{what} axis must be 1")
        out = out_channels or integer(here, p, "num_output", 0)
        spec: dict[str, Any] = {"type": kind, "out_channels": out}
        spec["kernel_size"] = sizes(here, p, "kernel", None)
        require(here, spec["kernel_size"] is not None, f"{what} needs kernel_size")
        put(spec, "stride", sizes(here, p, "stride", 1), 1)
        put(spec, "padding", sizes(here, p, "pad", 0, alone=True), 0)  # Caffe: pad_w 0
        put(spec, "dilation", sizes(here, p, "dilation", 1), 1)
        put(spec, "groups", groups or integer(here, p, "group", 1), 1)
        require(here, out > 0, f"{what} needs num_output, a whole number above 0 (in its "
                               f"convolution_param; got {out})")  # fmt: skip
        bias = flag(here, p, "bias_term", True)
        put(spec, "bias", bias, True)
        self._emit(layer, {**spec, **learning(here, layer, p, self.notes, bias)})

    def _convolutiondepthwise(self, layer: Message, last: bool) -> None:
        """The depthwise Convolution of the forks that MobileNet's and Xception's ports were
        written for: one filter per input channel, as a Convolution with a group for each.
        Their layer makes as many channels as it reads whatever num_output and group say (left
        out, or, in some ports, written wrong: said in a note)."""
        p, channels = layer.sub("convolution_param"), self.shapes[self._first_bottom(layer)][0]
        out, group = integer(self.here, p, "num_output", None), integer(self.here, p, "group", None)
        if (out, group) != (channels, channels) and {out, group} - {None, channels}:
            self.notes.append(f"layer {brief(layer.get('name', '?'))}: a {layer_type(layer)} over {channels} "
                              f"channels makes {channels} (its fork reads no num_output or "
                              f"group; given {out} and {group})")  # fmt: skip
        self._convolution(layer, last, groups=channels, out_channels=channels)

    def _depthwiseconvolution(self, layer: Message, last: bool) -> None:
        """The other forks' name for ConvolutionDepthwise (yonghenglh6's, which MobileNet v3's
        ports use)."""
        self._convolutiondepthwise(layer, last)

    def _deconvolution(self, layer: Message, last: bool) -> None:
        """Caffe's Deconvolution: torch's ConvTranspose2d with no output_padding; its weight
        blob is (in, out / group, kh, kw) as torch's."""
        self._convolution(layer, last, kind="conv_transpose")

    def _innerproduct(self, layer: Message, last: bool) -> None:
        p, here = layer.sub("inner_product_param"), self.here
        require(here, integer(here, p, "axis", 1) == 1, "InnerProduct axis must be 1")
        out = integer(here, p, "num_output", 0)
        require(here, out > 0, f"InnerProduct needs num_output, a whole number above 0 (in its "
                               f"inner_product_param; got {out})")  # fmt: skip
        spec: dict[str, Any] = {"type": "linear", "out_features": out}
        bias = flag(here, p, "bias_term", True)
        put(spec, "bias", bias, True)
        name = self._emit(layer, {**spec, **learning(here, layer, p, self.notes, bias)})
        if flag(here, p, "transpose", False):  # Caffe then holds W as (in, out): y = x @ W
            self.sources[name] = [(str(layer.get("name", "")), "linear_t")]

    def _pooling(self, layer: Message, last: bool) -> None:
        p = layer.sub("pooling_param")
        method = enum(self.here, p, "pool", _POOL_METHODS, "MAX")
        why = " (stochastic pooling is not imported)" if method == "STOCHASTIC" else ""
        require(self.here, method in ("MAX", "AVE"), f"pool: {method} is not MAX or AVE{why}")
        if flag(self.here, p, "global_pooling", False):
            window = [k for k in ("kernel_size", "kernel_h", "kernel_w") if p.get(k) is not None]
            require(self.here, not window, f"global_pooling: true takes no {window[0] if window else ''}"
                    " (its window is the whole input: Caffe refuses this too)")  # fmt: skip
            for field, only in (("stride", 1), ("pad", 0)):  # Caffe: only pad 0 and stride 1
                values = set(_pair(sizes(self.here, p, field, only)))
                require(self.here, values == {only}, f"global_pooling: true takes only {field} "
                        f"{only} (as Caffe), got {'x'.join(map(str, sorted(values)))}")  # fmt: skip
            shape = self.shapes[self._first_bottom(layer)]
            require(
                self.here, len(shape) == 3, f"global_pooling needs a (C, H, W) input, not {shape}"
            )
            if method == "AVE":  # keeps Caffe's (C, 1, 1) output
                return self._emit(layer, {"type": "adaptive_avgpool", "output_size": 1})
            return self._emit(
                layer, {"type": "maxpool", "kernel_size": list(shape[1:]), "stride": 1}
            )
        spec: dict[str, Any] = {"type": "maxpool" if method == "MAX" else "avgpool"}
        spec["kernel_size"] = sizes(self.here, p, "kernel", None)
        require(self.here, spec["kernel_size"] is not None, "Pooling needs kernel_size")
        spec["stride"] = sizes(
            self.here, p, "stride", 1
        )  # Caffe's default is 1, torch's the kernel
        put(spec, "padding", sizes(self.here, p, "pad", 0), 0)
        for field, values in (("kernel_size", spec["kernel_size"]), ("stride", spec["stride"])):
            low = min(_pair(values))  # (said before the checks that divide by them)
            require(self.here, low > 0, f"{field}: Input should be greater than 0 (got {low})")
        for k, pad in zip(_pair(spec["kernel_size"]), _pair(spec.get("padding", 0)), strict=True):
            require(self.here, pad <= k // 2, f"Pooling pad {pad} over half its kernel {k}: "
                    f"Caffe pads that far, torch's pooling (and so cnnkit's) {k // 2} at most")  # fmt: skip
        spec["ceil_mode"] = self._ceil_mode(p)
        if spec["ceil_mode"]:
            self._check_ceil_sizes(layer, spec)
        self._emit(layer, spec)

    def _ceil_mode(self, p: Message) -> bool:
        """Whether a pooling rounds its output size up: BVLC's `round_mode` (CEIL by default),
        or the `ceil_mode: true / false` of the forks that DenseNet's and ResNeXt's prototxts
        were written for (both given: they must agree)."""
        here = self.here
        mode = enum(here, p, "round_mode", tuple(_ROUND_MODES), "CEIL")  # Caffe rounds up
        require(here, mode in _ROUND_MODES, f"pooling_param round_mode: {brief(mode)} is "
                "not CEIL or FLOOR")  # fmt: skip
        if p.get("ceil_mode") is None:
            return _ROUND_MODES[mode]
        ceil = flag(here, p, "ceil_mode", True)
        agree = p.get("round_mode") is None or ceil == _ROUND_MODES[mode]
        require(here, agree, f"pooling_param ceil_mode: {str(ceil).lower()} and round_mode: "
                f"{mode} disagree (give one)")  # fmt: skip
        return ceil

    def _check_ceil_sizes(self, layer: Message, spec: dict[str, Any]) -> None:
        """Caffe drops a last window that starts past the input only where there is padding;
        without padding, a kernel smaller than its stride may leave Caffe one more output row
        or column, from outside the image, than torch's pooling (and so cnnkit's) computes."""
        shape = self.shapes[self._first_bottom(layer)]
        if len(shape) != 3:
            return  # (the network's own check says what is wrong with the input)
        kernel, stride = _pair(spec["kernel_size"]), _pair(spec["stride"])
        if any(_pair(spec.get("padding", 0))):  # (Caffe: pad_h or pad_w checks both sides)
            return
        for side, k, s in zip(shape[1:], kernel, stride, strict=True):
            caffe = -(-(side - k) // s) + 1  # Caffe's and torch's count, before the last check
            require(self.here, side < k or (caffe - 1) * s < side,
                    f"Pooling kernel {k} under stride {s}, rounding up, no padding, over {side} "
                    f"pixels: Caffe computes {caffe} outputs, the last from outside the image; "
                    f"cnnkit computes {caffe - 1}, as round_mode: FLOOR does in both")  # fmt: skip

    def _lrn(self, layer: Message, last: bool) -> None:
        p, here = layer.sub("lrn_param"), self.here
        region = enum(here, p, "norm_region", _LRN_REGIONS, "ACROSS_CHANNELS")
        require(here, region in _LRN_REGIONS, f"LRN {region} is not supported")
        spec = {"type": "lrn", "convention": "caffe", "size": integer(here, p, "local_size", 5)}
        require(
            here,
            spec["size"] % 2 == 1,
            f"LRN local_size {spec['size']}: Caffe takes odd "
            "sizes only (a window centred on the channel)",
        )
        spec.update(alpha=real(here, p, "alpha", 1.0), beta=real(here, p, "beta", 0.75))
        if region == "WITHIN_CHANNEL":  # Caffe ignores k there: 1 + alpha * mean(a^2)
            return self._emit(layer, {**spec, "region": "within_channel", "k": 1.0})
        self._emit(layer, {**spec, "k": real(here, p, "k", 1.0)})

    def _prelu(self, layer: Message, last: bool) -> None:
        p = layer.sub("prelu_param")
        spec: dict[str, Any] = {"type": "prelu"}
        put(spec, "channelwise", not flag(self.here, p, "channel_shared", False), True)
        filler = p.get("filler")
        if filler is not None:
            constant = str(filler.get("type", "constant")) == "constant"
            require(self.here, constant, "PReLU filler must be constant")
            put(spec, "init_slope", real(self.here, filler, "value", 0.0), 0.25)
        self._emit(layer, {**spec, **multipliers(self.here, layer, ("weight",))})  # the slope

    def _relu(self, layer: Message, last: bool) -> None:
        slope = real(self.here, layer.sub("relu_param"), "negative_slope", 0.0)
        spec = {"type": "leaky_relu", "negative_slope": slope} if slope else {"type": "relu"}
        self._emit(layer, spec)

    def _elu(self, layer: Message, last: bool) -> None:
        alpha = real(self.here, layer.sub("elu_param"), "alpha", 1.0)
        self._emit(layer, {"type": "elu", **({"alpha": alpha} if alpha != 1.0 else {})})

    def _swish(self, layer: Message, last: bool) -> None:
        beta = real(self.here, layer.sub("swish_param"), "beta", 1.0)
        require(self.here, beta == 1.0, f"Swish beta {beta:g}: only beta 1 (x * sigmoid(x), "
                "torch's SiLU) is imported")  # fmt: skip
        self._emit(layer, {"type": "silu"})

    def _bnll(self, layer: Message, last: bool) -> None:
        """Caffe's BNLL, log(1 + exp(x)): torch's Softplus (linear past 20, within 2e-9)."""
        self._emit(layer, {"type": "softplus"})

    def _clip(self, layer: Message, last: bool) -> None:
        """Caffe's Clip between min and max: MobileNet's ReLU6 where they are 0 and 6."""
        p = layer.sub("clip_param")
        require(self.here, None not in (p.get("min"), p.get("max")), "Clip needs min and max "
                "(as Caffe)")  # fmt: skip
        low, high = real(self.here, p, "min", None), real(self.here, p, "max", None)
        require(self.here, (low, high) == (0.0, 6.0), f"Clip from {low:g} to {high:g}: only 0 to 6 "
                "(ReLU6) is imported")  # fmt: skip
        self._emit(layer, {"type": "relu6"})

    def _relu6(self, layer: Message, last: bool) -> None:
        """The forks' ReLU6 (MobileNet v2's ports)."""
        self._emit(layer, {"type": "relu6"})

    def _power(self, layer: Message, last: bool) -> None:
        """Caffe's Power, (shift + scale * x) ** power: a `power` layer (none where it changes
        nothing)."""
        p = layer.sub("power_param")
        spec = {"type": "power"}
        for field, default in (("power", 1.0), ("scale", 1.0), ("shift", 0.0)):
            put(spec, field, real(self.here, p, field, default), default)
        if len(spec) == 1:
            return self._alias(layer, "Power")
        self._emit(layer, spec)

    def _tanh(self, layer: Message, last: bool) -> None:
        self._emit(layer, {"type": "tanh"})

    def _sigmoid(self, layer: Message, last: bool) -> None:
        self._emit(layer, {"type": "sigmoid"})

    def _dropout(self, layer: Message, last: bool) -> None:
        ratio = real(self.here, layer.sub("dropout_param"), "dropout_ratio", 0.5)
        self._emit(layer, {"type": "dropout", "p": ratio})

    def _batchnorm(self, layer: Message, last: bool) -> None:
        p = layer.sub("batch_norm_param")
        spec = {"type": "batchnorm", "eps": real(self.here, p, "eps", 1e-5), "affine": False}
        fraction = real(self.here, p, "moving_average_fraction", 0.999)
        require(self.here, 0 <= fraction <= 1, f"batch_norm_param moving_average_fraction: "
                f"{fraction:g} is not within 0 to 1 (each step keeps that part of the running "
                "average)")  # fmt: skip
        spec["momentum"] = round(1.0 - fraction, 9)
        self._emit(layer, spec)

    def _bn(self, layer: Message, last: bool) -> None:
        """The BN of the fork PSPNet was written for (hszhao/PSPNet's bn_layer): at test time
        slope * (x - mean) / sqrt(var + eps) + bias with its moving averages, blobs [slope,
        bias, mean, variance] of (1, C, 1, 1): torch's BatchNorm2d, affine. SegNet's and
        ENet's BN, of the same name, holds other blobs and is refused."""
        p, here = layer.sub("bn_param"), self.here
        other = [f for f in _OTHER_BN_FIELDS if p.get(f) is not None]
        require(here, not other, f"bn_param {{ {other[0] if other else ''} }}: another fork's BN "
                "(SegNet's and ENet's: other blobs, other test-time statistics), not imported")  # fmt: skip
        momentum = real(here, p, "momentum", 0.9)
        require(here, 0 <= momentum <= 1, f"bn_param momentum: {momentum:g} is not within 0 "
                "to 1 (each step keeps that part of the moving average)")  # fmt: skip
        spec = {"type": "batchnorm", "eps": real(here, p, "eps", 1e-5),
                "momentum": round(1.0 - momentum, 9)}  # fmt: skip
        given = fillers(here, p, {"weight": "slope_filler", "bias": "bias_filler"}, self.notes)
        learned = multipliers(here, layer, ("weight", "bias", "mean", "variance"))
        learned = {k: {n: v for n, v in m.items() if n in ("weight", "bias")}
                   for k, m in learned.items()}  # (the averages: never learned)  # fmt: skip
        name = self._emit(layer, {**spec, **{k: m for k, m in learned.items() if m}, **given})
        self.sources[name] = [(str(layer.get("name", "")), "bn_fork")]

    def _interp(self, layer: Message, last: bool) -> None:
        """The Interp of the forks PSPNet and DeepLab were written for: bilinear resizing with
        the corners aligned ((H_in - 1) / (H_out - 1)), to height x width, or by zoom_factor
        (H + (H - 1)(z - 1)) after shrink_factor ((H - 1) / s + 1); torch's align_corners."""
        p, here = layer.sub("interp_param"), self.here
        shape = self.shapes[self._first_bottom(layer)]
        require(here, len(shape) == 3, f"Interp of {fmt_shape(shape)}: it resizes (C, H, W) maps")
        pads = (integer(here, p, "pad_beg", 0), integer(here, p, "pad_end", 0))
        require(here, pads == (0, 0), f"Interp pad_beg {pads[0]}, pad_end {pads[1]}: only 0 (no "
                "cropping first) is imported")  # fmt: skip
        zoom, shrink = (
            integer(here, p, "zoom_factor", None),
            integer(here, p, "shrink_factor", None),
        )
        height, width = integer(here, p, "height", None), integer(here, p, "width", None)
        size = list(shape[1:])
        if zoom is None and shrink is None:
            require(here, None not in (height, width), "Interp needs zoom_factor, shrink_factor "
                    "or height and width (as Caffe)")  # fmt: skip
            size = [height, width]
        for factor, what in ((shrink, "shrink_factor"), (zoom, "zoom_factor")):
            require(here, factor is None or factor >= 1, f"Interp {what} {factor}: must be 1 or "
                    "more")  # fmt: skip
        if shrink is not None:
            size = [(n - 1) // shrink + 1 for n in size]
        if zoom is not None:
            size = [n + (n - 1) * (zoom - 1) for n in size]
        require(here, min(size) >= 1, f"Interp to {size}: sizes must be 1 or more")
        if size == list(shape[1:]):  # Caffe copies
            return self._alias(layer, "Interp")
        self._emit(layer, {"type": "upsample", "size": size, "mode": "bilinear",
                           "align_corners": True})  # fmt: skip

    def _scale(self, layer: Message, last: bool) -> None:
        """Caffe's Scale: a learned factor per channel (and shift, with bias_term). After a
        BatchNorm that nothing else reads, it is folded into it (torch's affine); elsewhere it
        is a `scale` layer, or with a shift a depthwise 1x1 convolution. With a second bottom,
        the first is multiplied by the second (`_scale_by`)."""
        held, bottoms = self._first_bottom(layer), len(layer.all("bottom"))
        if bottoms == 2:
            return self._scale_by(layer)
        require(self.here, bottoms == 1, f"a Scale takes 1 or 2 bottoms, not {bottoms}")
        caffe_name = str(layer.get("name", ""))
        p, dims = layer.sub("scale_param"), len(self.shapes[held]) + 1  # with the batch axis
        axis, count = integer(self.here, p, "axis", 1), integer(self.here, p, "num_axes", 1)
        per_channel = axis % dims == 1 if -dims <= axis < dims else False
        count_ok = count == 1 or (count == -1 and dims == 2)  # -1: to the last axis
        require(self.here, per_channel and count_ok, "Scale supports one factor per channel "
                f"only (axis 1, num_axes 1), not axis {axis}, num_axes {count}")  # fmt: skip
        bias = flag(self.here, p, "bias_term", False)
        learned = multipliers(self.here, layer, ("weight", "bias") if bias else ("weight",))
        blocks = {"weight": "filler", "bias": "bias_filler"} if bias else {"weight": "filler"}
        given = fillers(self.here, p, blocks, self.notes)  # Caffe's defaults: 1 and 0
        norm = self.layers[-1] if self.layers else {}
        after = norm.get("name") == held and norm.get("type") == "batchnorm"
        fold = after and layer in self.folds  # (the BatchNorm's output read by it alone)
        if not bias:  # x * gamma
            name = self._emit(layer, {"type": "scale", **learned, **given})
            self.sources[name] = [(caffe_name, "channel_scale")]
        elif fold and not norm["affine"]:
            norm.update(affine=True, **learned, **given)
            self.sources[held].append((caffe_name, "scale"))
            for top in layer.all("top"):
                self.blobs[top] = held
        else:  # gamma * x + beta: a depthwise 1x1 convolution computes it
            shape = self.shapes[held]
            why = "beside another reader of its BatchNorm's output" if after else (
                "not right after a BatchNorm")  # fmt: skip
            require(self.here, len(shape) == 3, f"Scale with bias_term of {fmt_shape(shape)} "
                    f"features {why}: cnnkit folds such a Scale into its BatchNorm only")  # fmt: skip
            conv = {"type": "conv", "out_channels": shape[0], "kernel_size": 1, "groups": shape[0],
                    "init": {"weight": 1.0, "bias": 0.0, **given.get("init", {})}, **learned}  # fmt: skip
            self.sources[self._emit(layer, conv)] = [(caffe_name, "scale_conv")]

    def _shufflechannel(self, layer: Message, last: bool) -> None:
        """The ShuffleChannel of the forks that ShuffleNet's ports (v1 and v2) were written
        for: the channels read as `group` rows and written out by columns, torch's (and
        torchvision's ShuffleNet's) channel shuffle."""
        group = integer(self.here, layer.sub("shuffle_channel_param"), "group", 1)
        require(self.here, group >= 1, f"ShuffleChannel group {group}: must be 1 or more")
        shape = self.shapes[self._first_bottom(layer)]
        if group == 1 or (len(shape) == 3 and group == shape[0]):  # the order it had
            return self._alias(layer, "ShuffleChannel")
        self._emit(layer, {"type": "channel_shuffle", "groups": group})

    def _softmax(self, layer: Message, last: bool) -> None:
        """The last layer's Softmax is dropped (the network returns logits, which classify turns
        to probabilities); one inside the net (over the channels: the colorization net's colour
        bins) is a `softmax` layer."""
        require(self.here, len(layer.all("top")) == 1, "a Softmax has one top (as Caffe)")
        if not last:
            return self._emit(layer, {"type": "softmax"})
        self._alias(layer, "Softmax")


SUPPORTED = (
    "Input", "Convolution", "Deconvolution", "Pooling", "LRN", "ReLU", "TanH", "Sigmoid",
    "InnerProduct", "Dropout", "Softmax", "Concat", "Eltwise", "BatchNorm", "Scale", "Flatten", "Split", "PReLU",
    "Reshape", "ConvolutionDepthwise", "Slice", "Axpy", "Crop", "ELU", "Swish", "BNLL", "Clip",
    "ReLU6", "Silence", "ShuffleChannel", "Power", "DepthwiseConvolution", "BN", "Interp",
)  # fmt: skip
# caffe.proto's enums in the order of their numbers (the text format takes either)
_POOL_METHODS = ("MAX", "AVE", "STOCHASTIC")
# bn_param fields of the other forks' BN (SegNet's, ENet's; an older PSPNet's): not this one
_OTHER_BN_FIELDS = ("scale_filler", "shift_filler", "bn_mode", "var_eps", "decay",
                    "moving_average", "axis")  # fmt: skip
_LRN_REGIONS = ("ACROSS_CHANNELS", "WITHIN_CHANNEL")
_ROUND_MODES = {"CEIL": True, "FLOOR": False}  # ceil_mode


def _pair(size: int | list[int]) -> tuple[int, int]:
    """A size field's (h, w)."""
    return (size[0], size[1]) if isinstance(size, list) else (size, size)
