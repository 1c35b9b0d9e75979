"""The Tinker API's protobuf payloads, read and written with the schema the official SDK ships
(``tinker.proto.tinker_public_pb2``: the wire contract itself, so the two sides cannot drift).

* ``read_forward_backward(body)``: a ``ForwardBackwardRequest`` (the one request sent as
  ``application/x-protobuf``) as plain values and ``actors.lora_tenants.Datum`` s;
* ``forward_backward_output(logprobs, metrics)``: the future's result, a ``ForwardBackwardOutput``
  with one ``ArrayRecord`` whose ``logprobs`` field batches every datum's tensor;
* ``sample_response(sequences, prompt_logprobs)``: the future's result of ``asample``.

Tokens are little-endian int32, tensors little-endian float32 or int64, dense or sparse CSR.
Anything malformed is a ``ValueError`` naming the datum and field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

PROTO = "application/x-protobuf"


def _pb() -> Any:
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


@dataclass
class ForwardBackward:
    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float]
    forward_only: bool
    data: list[Any]  # actors.lora_tenants.Datum


def _numpy_dtype(pb: Any, dtype: int) -> np.dtype:
    if dtype == pb.DTYPE_FLOAT32:
        return np.dtype("<f4")
    if dtype == pb.DTYPE_INT64:
        return np.dtype("<i8")
    raise ValueError(f"tensor dtype {dtype} is not float32 or int64")


def read_tensor(msg: Any) -> torch.Tensor:
    """A proto ``Tensor`` (dense or sparse CSR) as a dense torch tensor of its declared shape."""
    pb = _pb()
    dt = _numpy_dtype(pb, msg.dtype)
    shape = [int(s) for s in msg.shape]
    if msg.WhichOneof("encoding") == "sparse_csr":
        if len(shape) != 2:
            raise ValueError(f"a sparse CSR tensor needs a 2-D shape, got {shape}")
        values = np.frombuffer(msg.sparse_csr.values, dtype=dt)
        crow = np.frombuffer(msg.sparse_csr.crow_indices, dtype="<i8")
        col = np.frombuffer(msg.sparse_csr.col_indices, dtype="<i8")
        if len(crow) != shape[0] + 1 or len(col) != len(values) or (len(col) and col.max() >= shape[1]):
            raise ValueError("a sparse CSR tensor's indices do not fit its shape")
        dense = np.zeros(shape, dtype=dt)
        for r in range(shape[0]):
            dense[r, col[crow[r] : crow[r + 1]]] = values[crow[r] : crow[r + 1]]
        return torch.from_numpy(dense)
    flat = np.frombuffer(msg.dense, dtype=dt)
    if not shape:
        shape = [len(flat)]
    if int(np.prod(shape)) != len(flat):
        raise ValueError(f"a tensor of shape {shape} holds {len(flat)} values")
    return torch.from_numpy(flat.copy()).reshape(shape)


def _config(msg: Any) -> dict[str, float]:
    config = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        if v.WhichOneof("value") == "number":
            config[k] = float(v.number)
    return config


def read_forward_backward(body: bytes) -> ForwardBackward:
    from actors.lora_tenants import Datum

    pb = _pb()
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # the protobuf runtime's DecodeError
        raise ValueError(f"the body is not a ForwardBackwardRequest: {e}") from None
    data = []
    for i, d in enumerate(msg.data):
        tokens: list[int] = []
        for chunk in d.model_input:
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise ValueError(f"datum {i}: only encoded_text chunks are supported (got {chunk.WhichOneof('chunk')})")
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype="<i4").tolist())
        try:
            inputs = {k: read_tensor(v) for k, v in d.loss_fn_inputs.items()}
        except ValueError as e:
            raise ValueError(f"datum {i}: {e}") from None
        data.append(Datum(tokens=tokens, inputs=inputs))
    return ForwardBackward(msg.model_id, int(msg.seq_id), msg.loss_fn, _config(msg), bool(msg.forward_only), data)


def forward_backward_output(logprobs: list[np.ndarray], metrics: dict[str, float]) -> bytes:
    """One ``ArrayRecord``: every datum's ``logprobs`` in one float32 ``BatchedTensor``."""
    pb = _pb()
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for k, v in metrics.items():
        out.metrics[k] = float(v)
    record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(logprobs))
    arrays = [np.ascontiguousarray(a, dtype="<f4") for a in logprobs]
    trailing = list(arrays[0].shape[1:]) if arrays else []
    offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype("<i8")
    field = record.fields["logprobs"]
    field.data = b"".join(a.tobytes() for a in arrays)
    field.offsets = offsets.tobytes()
    field.dtype = pb.DTYPE_FLOAT32
    field.trailing_shape.extend(trailing)
    return out.SerializeToString()


def sample_response(sequences: list[dict[str, Any]], prompt_logprobs: list[float] | None = None) -> bytes:
    """``sequences``: ``{"tokens", "logprobs", "stop_reason": "stop" | "length"}`` each."""
    pb = _pb()
    out = pb.SampleResponse()
    for s in sequences:
        seq = out.sequences.add()
        seq.stop_reason = pb.STOP_REASON_LENGTH if s["stop_reason"] == "length" else pb.STOP_REASON_STOP
        seq.tokens = np.asarray(s["tokens"], dtype="<i4").tobytes()
        seq.logprobs = np.asarray(s["logprobs"], dtype="<f4").tobytes()
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, dtype="<f4").tobytes()
    return out.SerializeToString()
