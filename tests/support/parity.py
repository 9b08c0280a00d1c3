"""What the ONNX runtimes' parity with the PyTorch reference is checked on, here and on emulated arm64."""
from __future__ import annotations

SHAPE, CLASSES = (1, 28, 28), 10
PARAM_ATOL = 1e-5
"""Largest difference allowed between a runtime's weights and the reference's after one local epoch."""
