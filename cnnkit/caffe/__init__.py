"""Caffe's networks in cnnkit: a deploy.prototxt translated into a network file (translate.py)
and a .caffemodel's weights read into a state_dict (weights.py)."""

from cnnkit.caffe.translate import (
    CaffeImport,
    import_caffe,
    import_caffe_weights,
    network_yaml,
    read_caffe,
    translate,
)
from cnnkit.prototxt import parse_prototxt

__all__ = [
    "CaffeImport",
    "import_caffe",
    "import_caffe_weights",
    "network_yaml",
    "parse_prototxt",
    "read_caffe",
    "translate",
]
