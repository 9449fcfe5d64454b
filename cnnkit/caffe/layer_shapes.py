"""The Caffe layer types that reshape, join or split blobs (`ShapeTypes`, a base of
LayerTypes): Flatten, Reshape, Concat, Eltwise, Axpy, a Scale by a second bottom, Slice, Crop,
Split and Silence, each read with Caffe's defaults and semantics into cnnkit layers."""

from __future__ import annotations

import math

from cnnkit.caffe.fields import as_integer, as_real, enum, flag, integer, put, require
from cnnkit.errors import brief
from cnnkit.nn.layers import fmt_shape
from cnnkit.prototxt import Message

_ELTWISE = {"PROD": "mul", "SUM": "add", "MAX": "max"}


class ShapeTypes:
    """Handlers of the Translator (caffe/translator.py) for the layers that move values
    between blobs rather than compute per value."""

    def _flatten(self, layer: Message, last: bool) -> None:
        p, here = layer.sub("flatten_param"), self.here
        ok = integer(here, p, "axis", 1) == 1 and integer(here, p, "end_axis", -1) == -1
        require(here, ok, "Flatten supports axis 1 to the end only")
        self._emit(layer, {"type": "flatten"})

    def _reshape(self, layer: Message, last: bool) -> None:
        """Caffe's Reshape of each image: from axis 0, the first dim is the batch (0 as it is,
        or -1 or 1), from axis 1 the dims are the image's; 0 copies the bottom's size on its
        axis, -1 takes what is left, as in Caffe. A flatten (TensorFlow ports' `dim: 0 dim: 0`
        over (N, C, 1, 1) scores) is a `flatten`, one that changes nothing no layer, any other
        a `reshape`."""
        p, here, held = layer.sub("reshape_param"), self.here, self._first_bottom(layer)
        axis, count = integer(here, p, "axis", 0), integer(here, p, "num_axes", -1)
        require(here, axis in (0, 1) and count == -1, f"Reshape from axis {axis} over {count} "
                "axes: cnnkit reshapes from axis 0 or 1 to the last (num_axes -1)")  # fmt: skip
        shape = p.get("shape")
        dims = [as_integer(here, "dim", d) for d in shape.all("dim")] if isinstance(
            shape, Message) else []  # fmt: skip
        if axis == 0:
            require(here, dims[:1] in ([0], [-1], [1]) and dims[1:].count(-1) <= (dims[0] != -1),
                    f"Reshape dims {dims}: the first is the batch (0: as it is, or -1 or 1), "
                    "and one -1 at most")  # fmt: skip
            dims = dims[1:]
        source = self.shapes[held]  # per image: dims[i] is axis i + 1 of Caffe's blob
        for i, d in enumerate(dims):
            require(here, d != 0 or i < len(source), f"Reshape dim 0 at axis {i + 1} copies an "
                    f"axis the {fmt_shape(source)} bottom has not")  # fmt: skip
        target = [source[i] if d == 0 else d for i, d in enumerate(dims)]
        known = math.prod(n for n in target if n != -1)
        if target.count(-1) == 1 and known > 0 and math.prod(source) % known == 0:
            target[target.index(-1)] = math.prod(source) // known
        if tuple(target) == tuple(source):
            return self._alias(layer, "Reshape")
        if target == [math.prod(source)]:
            return self._emit(layer, {"type": "flatten"})
        require(here, 1 <= len(target) <= 3, f"Reshape of {fmt_shape(source)} to {target}: "
                "cnnkit's shapes are (C, H, W), (C, L) or (F) per image")  # fmt: skip
        self._emit(layer, {"type": "reshape", "shape": target})

    def _concat(self, layer: Message, last: bool) -> None:
        p, here = layer.sub("concat_param"), self.here
        axis = integer(here, p, "axis", integer(here, p, "concat_dim", 1))
        dims = (
            len(self.shapes[self._bottom(layer.all("bottom")[0])]) + 1 if layer.all("bottom") else 4
        )
        require(
            here,
            -dims <= axis < dims and axis % dims == 1,
            "Concat supports the channel axis (1, or -3 of 4) only",
        )
        if len(layer.all("bottom")) == 1:  # Caffe's top shares the bottom's data
            return self._alias(layer, "Concat")
        self._emit(layer, {"type": "concat"})

    def _eltwise(self, layer: Message, last: bool) -> None:
        p = layer.sub("eltwise_param")
        op = enum(self.here, p, "operation", tuple(_ELTWISE), "SUM")
        require(self.here, op in _ELTWISE, f"Eltwise operation {brief(op)}: SUM, PROD or MAX")
        coeffs = [as_real(self.here, "coeff", c) for c in p.all("coeff")]
        spec = {"type": _ELTWISE[op]}
        if coeffs:  # as Caffe checks them: for a sum, one per input
            require(self.here, op == "SUM", f"Eltwise {op} takes no coeff (Caffe: SUM only)")
            bottoms = len(layer.all("bottom"))
            require(self.here, len(coeffs) == bottoms, f"Eltwise coeff: {len(coeffs)} given "
                    f"for {bottoms} bottoms (Caffe: one per bottom)")  # fmt: skip
            put(spec, "coeff", coeffs, [1.0] * bottoms)
        self._emit(layer, spec)

    def _scale_by(self, layer: Message) -> None:
        """A Scale of its first bottom by its second, with axis 0: each image's factors, of
        the shape its first axes have, broadcast over the rest (SE-BN-Inception's gate, (C,)
        over a (C, H, W) map): a `mul`, after a `reshape` of the factors to (C, 1, 1)."""
        p, here = layer.sub("scale_param"), self.here
        x, factors = (self._bottom(b) for b in layer.all("bottom"))
        shape, by = self.shapes[x], self.shapes[factors]
        axis, dims = integer(here, p, "axis", 1), len(shape) + 1
        require(here, axis % dims == 0 if -dims <= axis < dims else False, "Scale by a second "
                f"bottom: axis 0 only (each image's own factors), not axis {axis}")  # fmt: skip
        require(here, not flag(here, p, "bias_term", False), "Scale by a second bottom with "
                "bias_term is not imported")  # fmt: skip
        require(here, shape[: len(by)] == by, f"Scale of {fmt_shape(shape)} by {fmt_shape(by)}: "
                "the factors' shape must be the first of the input's (as Caffe's)")  # fmt: skip
        self._emit(layer, {"type": "mul"}, inputs=[x, self._broadcast(layer, factors, shape)])

    def _axpy(self, layer: Message, last: bool) -> None:
        """SENet's Axpy (its own Caffe's layer): a * x + y, the squeeze-excitation gate `a`,
        (C, 1, 1) or (C,), times the block's map x, plus the shortcut y: a `mul` then an `add`."""
        bottoms = [self._bottom(b) for b in layer.all("bottom")]
        require(self.here, len(bottoms) == 3, f"an Axpy takes 3 bottoms (a, x, y), not "
                f"{len(bottoms)}")  # fmt: skip
        a, x, y = bottoms
        shape, gate = self.shapes[x], self.shapes[a]
        require(self.here, shape == self.shapes[y] and gate in ((shape[0],), (shape[0], 1, 1)[
            : len(shape)]), f"Axpy of a {fmt_shape(gate)}, x {fmt_shape(shape)} and y "
            f"{fmt_shape(self.shapes[y])}: a is one factor per channel of x, and y x's shape")  # fmt: skip
        name = f"{layer.get('name') or 'axpy'}_ax"
        scaled = self._emit(layer, {"type": "mul"}, inputs=[x, self._broadcast(layer, a, shape)],
                            tops=[], name=name)  # fmt: skip
        self._emit(layer, {"type": "add"}, inputs=[scaled, y])

    def _broadcast(self, layer: Message, factors: str, shape: tuple[int, ...]) -> str:
        """`factors` as a value that broadcasts over `shape` (its first axes): itself where it
        has shape's rank, else a `reshape` to it with 1s after (named after the layer)."""
        by = self.shapes[factors]
        if len(by) == len(shape):
            return factors
        spec = {"type": "reshape", "shape": [*by, *[1] * (len(shape) - len(by))]}
        return self._emit(layer, spec, inputs=[factors], tops=[],
                          name=f"{layer.get('name') or 'scale'}_factors")  # fmt: skip

    def _slice(self, layer: Message, last: bool) -> None:
        """Caffe's Slice of the channels: one channel_split per top, named after it, cut at the
        slice_points (or into equal parts where none is given)."""
        p, here, tops = layer.sub("slice_param"), self.here, layer.all("top")
        bottoms, source = len(layer.all("bottom")), self._first_bottom(layer)
        require(here, bottoms == 1, f"a Slice takes one bottom, not {bottoms} (as Caffe)")
        dims = len(self.shapes[source]) + 1  # with the batch axis
        axis = integer(here, p, "axis", integer(here, p, "slice_dim", 1))
        require(here, -dims <= axis < dims and axis % dims == 1, f"Slice axis {axis}: only the "
                "channel axis (1) is imported")  # fmt: skip
        points = [as_integer(here, "slice_point", n) for n in p.all("slice_point")]
        require(here, not points or len(points) == len(tops) - 1, f"Slice: {len(points)} "
                f"slice_point for {len(tops)} tops (Caffe: one fewer than the tops)")  # fmt: skip
        require(here, len(tops) >= 2 or points, "a Slice without slice_point needs 2 tops or more")
        channels = self.shapes[source][0]
        require(here, points or channels % len(tops) == 0, f"Slice of {channels} channels into "
                f"{len(tops)} equal tops: {len(tops)} does not divide {channels} (give the "
                "slice_points)")  # fmt: skip
        cut = {"points": points} if points else {"parts": len(tops)}
        for part, top in enumerate(tops):
            self._emit(layer, {"type": "channel_split", **cut, "part": part}, tops=[top], name=top)

    def _crop(self, layer: Message, last: bool) -> None:
        """Caffe's Crop of the first bottom to the second's height and width (axis 2), from
        the offsets (none: 0; one: both sides; two: top and left): FCN's."""
        p, here, bottoms = layer.sub("crop_param"), self.here, layer.all("bottom")
        require(here, len(bottoms) == 2, f"a Crop takes 2 bottoms (what to crop, and one of the "
                f"size to crop it to), not {len(bottoms)}")  # fmt: skip
        shape = self.shapes[self._first_bottom(layer)]
        dims, axis = len(shape) + 1, integer(here, p, "axis", 2)
        require(here, len(shape) == 3 and -dims <= axis < dims and axis % dims == 2, "Crop "
                f"supports the height and width (axis 2 of an (N, C, H, W) blob) only, not axis "
                f"{axis} of {fmt_shape(shape)}")  # fmt: skip
        offsets = [as_integer(here, "offset", n) for n in p.all("offset")]
        require(here, len(offsets) <= 2, f"Crop: {len(offsets)} offsets for 2 axes (Caffe: none, "
                "one for both, or one each)")  # fmt: skip
        offset = (offsets * 2)[:2] if offsets else [0, 0]
        self._emit(layer, {"type": "crop", **({"offset": offset} if any(offset) else {})})

    def _silence(self, layer: Message, last: bool) -> None:
        """Caffe's Silence: its bottoms are computed and dropped (a Slice's unused top); the
        last layer, silenced and read by no other, is left out (cnnkit's output is the last)."""
        for value in [self._bottom(b) for b in layer.all("bottom")]:
            end = self.layers[-1] if self.layers else {}
            if end.get("name") == value and value not in self.read and value not in self.sources:
                self.layers.pop()
                self.blobs = {blob: held for blob, held in self.blobs.items() if held != value}
            else:
                self.read.add(value)

    def _split(self, layer: Message, last: bool) -> None:
        self._alias(layer, "Split")
