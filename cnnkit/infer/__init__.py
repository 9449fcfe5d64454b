"""Inference: classify images (centre crop or 10 crops), export (ONNX, TorchScript,
safetensors), draw networks and filters, detect faces."""

from cnnkit.infer.classify import Classifier, Prediction

__all__ = ["Classifier", "Prediction"]
