"""Deliberately wrong step graphs: what the parity gate must refuse."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from device_runtime.artifact_contract import next_name


def scaled_gradient(step: onnx.ModelProto, parameter: str, factor: float) -> onnx.ModelProto:
    """The step graph with ``parameter``'s update p − lr·g rewritten to p − factor·lr·g."""
    wrong = onnx.ModelProto()
    wrong.CopyFrom(step)
    out = next_name(parameter)
    producer = next(n for n in wrong.graph.node if out in n.output)
    producer.output[list(producer.output).index(out)] = "correct_update"
    wrong.graph.initializer.append(numpy_helper.from_array(np.array(factor, np.float32), "factor"))
    wrong.graph.initializer.append(numpy_helper.from_array(np.array(1.0 - factor, np.float32), "keep"))
    wrong.graph.node.extend([  # factor·(p − lr·g) + (1 − factor)·p = p − factor·lr·g
        helper.make_node("Mul", ["correct_update", "factor"], ["scaled_update"]),
        helper.make_node("Mul", [parameter, "keep"], ["kept_part"]),
        helper.make_node("Add", ["scaled_update", "kept_part"], [out]),
    ])
    return wrong
