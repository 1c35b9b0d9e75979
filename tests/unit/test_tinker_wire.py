"""The Tinker API's protobuf payloads (``serving/tinker/wire.py``) against the official SDK's own
encoder and decoders (``tinker.proto.request_conv`` / ``response_conv``): what the SDK writes is
read back exactly, and what the service writes the SDK reads as meant."""

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")

from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker.proto.response_conv import (  # noqa: E402
    deserialize_forward_backward_output,
    deserialize_sample_response,
)
from tinker.types.forward_backward_input import ForwardBackwardInput  # noqa: E402
from tinker.types.forward_backward_request import ForwardBackwardRequest  # noqa: E402

from serving.tinker.wire import forward_backward_output, read_forward_backward, sample_response  # noqa: E402


def _sdk_body(data, loss_fn="cross_entropy", config=None, seq_id=3, forward_only=False) -> bytes:
    request = ForwardBackwardRequest(
        forward_backward_input=ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
        model_id="s:train:0",
        seq_id=seq_id,
    )
    msg = forward_backward_request_to_proto(request)
    msg.forward_only = forward_only
    return msg.SerializeToString()


def test_a_request_the_sdk_wrote_is_read_back_exactly():
    tokens = [[5, 70000, 3], [9, 8]]  # a token id over 16 bits: int32 on the wire
    data = [
        tinker.Datum(
            model_input=tinker.ModelInput.from_ints(t),
            loss_fn_inputs={
                "target_tokens": np.array(t[1:] + [1], dtype=np.int64),
                "weights": np.linspace(0, 1, len(t)).astype(np.float32),
                "advantages": np.full(len(t), -0.25, dtype=np.float32),
            },
        )
        for t in tokens
    ]
    got = read_forward_backward(_sdk_body(data, "ppo", {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}))
    assert (got.model_id, got.seq_id, got.loss_fn, got.forward_only) == ("s:train:0", 3, "ppo", False)
    assert got.config == pytest.approx({"clip_low_threshold": 0.7, "clip_high_threshold": 1.3})
    for d, t in zip(got.data, tokens):
        assert d.tokens == t
        assert d.inputs["target_tokens"].tolist() == t[1:] + [1] and d.inputs["target_tokens"].dtype == torch.int64
        torch.testing.assert_close(d.inputs["weights"], torch.linspace(0, 1, len(t)))
        assert d.inputs["advantages"].tolist() == [-0.25] * len(t)


def test_a_sparse_two_dimensional_target_is_read_as_its_dense_matrix():
    targets = torch.zeros(4, 3, dtype=torch.int64)
    targets[0, 1], targets[2, 0], targets[2, 2] = 11, 12, 13
    weights = torch.zeros(4, 3)
    weights[0, 1], weights[2, 0], weights[2, 2] = 1.0, 0.5, 0.25
    datum = tinker.Datum(
        model_input=tinker.ModelInput.from_ints([1, 2, 3, 4]),
        loss_fn_inputs={"target_tokens": targets, "weights": weights},
    )
    body = _sdk_body([datum])
    from tinker.proto import tinker_public_pb2

    msg = tinker_public_pb2.ForwardBackwardRequest.FromString(body)
    assert msg.data[0].loss_fn_inputs["target_tokens"].WhichOneof("encoding") == "sparse_csr"  # the SDK chose CSR
    got = read_forward_backward(body).data[0]
    assert torch.equal(got.inputs["target_tokens"], targets) and torch.equal(got.inputs["weights"], weights)


def test_a_body_that_is_not_a_request_is_refused():
    with pytest.raises(ValueError, match="not a ForwardBackwardRequest"):
        read_forward_backward(b"\xff\xff\xff not protobuf")


def test_the_sdk_reads_the_services_outputs_as_meant():
    logprobs = [np.array([-1.0, -2.0, -3.0], np.float32), np.array([-0.5], np.float32)]
    out = deserialize_forward_backward_output(forward_backward_output(logprobs, {"loss:sum": 6.5}))
    assert out.metrics == {"loss:sum": 6.5}
    assert [o["logprobs"].to_numpy().tolist() for o in out.loss_fn_outputs] == [[-1.0, -2.0, -3.0], [-0.5]]
    two_d = [np.array([[-1.0, -2.0], [-3.0, -4.0]], np.float32)]
    out = deserialize_forward_backward_output(forward_backward_output(two_d, {"loss:sum": 1.0}))
    assert out.loss_fn_outputs[0]["logprobs"].shape == [2, 2]

    seqs = [
        {"tokens": [5, 6, 7], "logprobs": [-0.1, -0.2, -0.3], "stop_reason": "length"},
        {"tokens": [8], "logprobs": [-1.5], "stop_reason": "stop"},
    ]
    sampled = deserialize_sample_response(sample_response(seqs, [float("nan"), -2.0]))
    assert [s.tokens for s in sampled.sequences] == [[5, 6, 7], [8]]
    assert [s.stop_reason for s in sampled.sequences] == ["length", "stop"]
    np.testing.assert_allclose(sampled.sequences[0].logprobs, [-0.1, -0.2, -0.3], rtol=1e-6)
    assert sampled.prompt_logprobs[1] == -2.0
