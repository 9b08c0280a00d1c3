"""The per-step part of the FedARA local objective as an onnxblock loss, inside the training graph:
L = CE + λ·L_FAC.

Same expression as ``fedcore.objective.local_loss`` (tests/export/test_parity.py holds them equal):
- CE: SoftmaxCrossEntropyLoss, mean over the batch;
- L_FAC = Σ_i m_{y_i}·mean_d (f_i − a_{y_i,d})² / max(Σ_i m_{y_i}, 1), with anchors and mask as graph inputs.
λ is a scalar graph input, so one artifact set serves every round. The Frobenius term μ·Σ‖U Vᵀ‖²_F is not in
the graph: it dominated the factorized step, so the device applies it once per epoch as a decoupled SGD step
(``device_runtime.frobenius``).
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.training import onnxblock

from device_runtime.artifact_contract import ANCHOR_MASK, ANCHORS, BATCH_DIM, LABELS, LAM, LOSS



class FedAraLoss(onnxblock.Block):
    """build(logits, features) -> name of the total loss; adds the labels/anchors/mask/λ graph inputs."""

    def __init__(self, num_classes: int, feature_dim: int):
        super().__init__()
        self.num_classes = num_classes
        self.feature_dim = feature_dim

    def _node(self, op: str, inputs: list[str], output: str | None = None, **attributes) -> str:
        out = output or onnxblock._graph_utils.generate_graph_name(f"fedara.{op.lower()}")
        self.base.graph.node.append(helper.make_node(
            op, inputs, [out], name=onnxblock._graph_utils.generate_graph_name(f"fedara.{op}"), **attributes))
        return out

    def _constant(self, value: float) -> str:
        name = onnxblock._graph_utils.generate_graph_name("fedara.const")
        self.base.graph.initializer.append(numpy_helper.from_array(np.array(value, np.float32), name))
        return name

    def _add_inputs(self) -> None:
        self.base.graph.input.extend([
            helper.make_tensor_value_info(LABELS, TensorProto.INT64, [BATCH_DIM]),
            helper.make_tensor_value_info(ANCHORS, TensorProto.FLOAT, [self.num_classes, self.feature_dim]),
            helper.make_tensor_value_info(ANCHOR_MASK, TensorProto.FLOAT, [self.num_classes]),
            helper.make_tensor_value_info(LAM, TensorProto.FLOAT, []),
        ])

    def _cross_entropy(self, logits: str) -> str:
        out = onnxblock._graph_utils.generate_graph_name("fedara.ce")
        log_prob = onnxblock._graph_utils.generate_graph_name("fedara.log_prob")
        self.base.graph.node.append(helper.make_node(
            "SoftmaxCrossEntropyLoss", [logits, LABELS], [out, log_prob], reduction="mean",
            name=onnxblock._graph_utils.generate_graph_name("fedara.SoftmaxCrossEntropyLoss")))
        return out

    def _anchor_loss(self, features: str) -> str:
        diff = self._node("Sub", [features, self._node("Gather", [ANCHORS, LABELS], axis=0)])
        per_sample = self._node("ReduceMean", [self._node("Mul", [diff, diff])], axes=[1], keepdims=0)
        weights = self._node("Gather", [ANCHOR_MASK, LABELS], axis=0)
        weighted = self._node("ReduceSum", [self._node("Mul", [weights, per_sample])], keepdims=0)
        count = self._node("Max", [self._node("ReduceSum", [weights], keepdims=0), self._constant(1.0)])
        return self._node("Div", [weighted, count])

    def build(self, logits: str, features: str) -> str:
        self._add_inputs()
        loss = self._node("Add", [self._cross_entropy(logits), self._node("Mul", [LAM, self._anchor_loss(features)])])
        return self._node("Identity", [loss], LOSS)

