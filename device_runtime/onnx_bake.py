"""Turn an eval graph whose weights are graph inputs into a self-contained inference graph, without the onnx
package: a minimal protobuf reader and writer (stdlib and numpy) edits the ONNX ``ModelProto`` bytes.

The edit (:func:`bake`): every weight input leaves ``graph.input`` and comes back as an initializer holding its
value (``raw_data``, little-endian); the graph keeps the outputs asked for and gains ``probabilities``, a Softmax
over the logits. Every other field of the model and the graph is copied byte for byte. Field numbers are those
of onnx.proto3 (stable since IR version 3).
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np

# ModelProto, GraphProto, NodeProto, AttributeProto, ValueInfoProto, TensorProto field numbers (onnx.proto3).
MODEL_GRAPH = 7
GRAPH_NODE, GRAPH_INITIALIZER, GRAPH_INPUT, GRAPH_OUTPUT = 1, 5, 11, 12
NODE_INPUT, NODE_OUTPUT, NODE_NAME, NODE_OP_TYPE, NODE_ATTRIBUTE = 1, 2, 3, 4, 5
ATTRIBUTE_NAME, ATTRIBUTE_I, ATTRIBUTE_TYPE, ATTRIBUTE_TYPE_INT = 1, 3, 20, 2
VALUE_INFO_NAME, VALUE_INFO_TYPE = 1, 2
TENSOR_DIMS, TENSOR_DATA_TYPE, TENSOR_NAME, TENSOR_RAW_DATA = 1, 2, 8, 9
ONNX_FLOAT = 1
VARINT, FIXED64, LENGTH_DELIMITED, FIXED32 = 0, 1, 2, 5


class GraphEditError(ValueError):
    """The bytes are not an ONNX model this edit understands, or the weights do not match its inputs."""


# -- wire format ------------------------------------------------------------------------------


def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # int64 fields: two's complement in ten bytes
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise GraphEditError("truncated or malformed varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def fields(buf: bytes) -> Iterator[tuple[int, int, bytes, bytes]]:
    """(field number, wire type, the field's bytes with its tag, its payload) of each field of a message."""
    pos = 0
    while pos < len(buf):
        start = pos
        key, pos = _read_varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == VARINT:
            _, pos = _read_varint(buf, pos)
            payload_start = start
        elif wire == LENGTH_DELIMITED:
            length, payload_start = _read_varint(buf, pos)
            pos = payload_start + length
        elif wire in (FIXED64, FIXED32):
            payload_start = pos
            pos += 8 if wire == FIXED64 else 4
        else:
            raise GraphEditError(f"unsupported protobuf wire type {wire} (field {number})")
        if pos > len(buf):
            raise GraphEditError(f"field {number} runs past the end of its message")
        yield number, wire, buf[start:pos], buf[payload_start:pos]


def _bytes_field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | LENGTH_DELIMITED) + _varint(len(payload)) + payload


def _field_head(number: int, length: int) -> bytes:
    """The tag and length of a length-delimited field whose payload follows separately."""
    return _varint(number << 3 | LENGTH_DELIMITED) + _varint(length)


def _int_field(number: int, value: int) -> bytes:
    return _varint(number << 3 | VARINT) + _varint(value)


def _string(message: bytes, number: int) -> str | None:
    """The first length-delimited field ``number`` of a message, as text."""
    for n, wire, _, payload in fields(message):
        if n == number and wire == LENGTH_DELIMITED:
            return payload.decode()
    return None


# -- ONNX messages ----------------------------------------------------------------------------


def tensor_proto(name: str, value: np.ndarray) -> list[bytes | memoryview]:
    """A float32 TensorProto holding ``value`` as raw little-endian data, in pieces: the data is a view of
    ``value``'s memory, not a copy (a model's weights are most of its device's memory)."""
    if value.dtype != np.float32:
        raise GraphEditError(f"weight {name} is {value.dtype}; the inference graph takes float32 weights")
    data = memoryview(np.ascontiguousarray(value, "<f4")).cast("B")
    head = (b"".join(_int_field(TENSOR_DIMS, int(d)) for d in value.shape) + _int_field(TENSOR_DATA_TYPE, ONNX_FLOAT)
            + _bytes_field(TENSOR_NAME, name.encode()) + _field_head(TENSOR_RAW_DATA, data.nbytes))
    return [head, data]


def softmax_node(source: str, target: str) -> bytes:
    """NodeProto: ``target = Softmax(source)`` over axis 1 (the class axis of batch × classes logits)."""
    axis = (_bytes_field(ATTRIBUTE_NAME, b"axis") + _int_field(ATTRIBUTE_I, 1)
            + _int_field(ATTRIBUTE_TYPE, ATTRIBUTE_TYPE_INT))
    return (_bytes_field(NODE_INPUT, source.encode()) + _bytes_field(NODE_OUTPUT, target.encode())
            + _bytes_field(NODE_NAME, f"{target}_softmax".encode()) + _bytes_field(NODE_OP_TYPE, b"Softmax")
            + _bytes_field(NODE_ATTRIBUTE, axis))


def _value_info_type(value_info: bytes) -> bytes:
    for n, wire, _, payload in fields(value_info):
        if n == VALUE_INFO_TYPE and wire == LENGTH_DELIMITED:
            return payload
    raise GraphEditError("a graph output has no type")


def bake(model: bytes, weights: dict[str, np.ndarray], *, logits: str, probabilities: str,
         keep_outputs: tuple[str, ...]) -> bytes:
    """The model with ``weights`` moved from graph inputs into initializers, only ``keep_outputs`` (which must
    include ``logits``) as outputs, and ``probabilities`` = Softmax(``logits``) added as the last output.

    Raises GraphEditError when a weight is not a graph input or an output to keep is missing."""
    graphs = [payload for n, wire, _, payload in fields(model) if n == MODEL_GRAPH and wire == LENGTH_DELIMITED]
    if len(graphs) != 1:
        raise GraphEditError(f"expected one graph in the model, found {len(graphs)}")
    graph: list[bytes | memoryview] = []
    inputs_seen, outputs_seen, logits_type = set(), [], None
    for number, wire, raw, payload in fields(graphs[0]):
        if number == GRAPH_INPUT and wire == LENGTH_DELIMITED:
            name = _string(payload, VALUE_INFO_NAME)
            inputs_seen.add(name)
            if name in weights:
                continue
        elif number == GRAPH_OUTPUT and wire == LENGTH_DELIMITED:
            name = _string(payload, VALUE_INFO_NAME)
            if name not in keep_outputs:
                continue
            outputs_seen.append(name)
            if name == logits:
                logits_type = _value_info_type(payload)
        graph.append(raw)
    missing = sorted(set(weights) - inputs_seen)
    if missing:
        raise GraphEditError(f"weights {missing[:5]} are not inputs of the graph")
    if logits_type is None or set(outputs_seen) != set(keep_outputs):
        raise GraphEditError(f"graph outputs {outputs_seen} lack some of {list(keep_outputs)}")
    for name, value in weights.items():
        tensor = tensor_proto(name, value)
        graph += [_field_head(GRAPH_INITIALIZER, sum(len(piece) for piece in tensor)), *tensor]
    graph.append(_bytes_field(GRAPH_NODE, softmax_node(logits, probabilities)))
    graph.append(_bytes_field(GRAPH_OUTPUT, _bytes_field(VALUE_INFO_NAME, probabilities.encode())
                              + _bytes_field(VALUE_INFO_TYPE, logits_type)))
    out: list[bytes | memoryview] = []
    for number, _, raw, _ in fields(model):
        if number == MODEL_GRAPH:
            out += [_field_head(MODEL_GRAPH, sum(len(piece) for piece in graph)), *graph]
        else:
            out.append(raw)
    return b"".join(out)  # the one copy of the weights
