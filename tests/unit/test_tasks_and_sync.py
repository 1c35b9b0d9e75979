import numpy as np
import pytest
import torch

from actors.data.tasks import file_rows, load_prompts
from cluster.roles.weight_sync import pack, unpack


def test_jsonl_malformed_rows_are_counted(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "2+2?", "answer": "4"}\nnot json\n{"prompt": ""}\n[1,2]\n{"prompt": "x"}\n\n')
    ps = file_rows(str(f), "Answer.")
    assert [r["prompt"] for r in ps.rows] == ["2+2? Answer.", "x Answer."]
    assert ps.skipped == {"malformed_row": 2, "empty_or_malformed_prompt": 1}


def test_held_out_split_is_disjoint():
    train, held = load_prompts(
        "basic_arithmetic", 200, 20, 0, {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}, ""
    )
    assert len(train) == 200 and len(held) == 20
    assert not {r["prompt"] for r in train.rows} & {r["prompt"] for r in held.rows}


def test_unknown_task_is_a_clear_error():
    with pytest.raises(ValueError, match="no_such_task"):
        load_prompts("no_such_task", 10, 2, 0, {}, "")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pack_unpack_roundtrip(dtype):
    sd = {"a.weight": torch.randn(3, 4), "b.bias": torch.randn(5), "c": torch.randn(2, 2, 2)}
    p = pack(sd, dtype, version=9)
    assert isinstance(p.buffer, np.ndarray) and p.buffer.ndim == 1 and p.version == 9
    assert p.nbytes == 25 * (4 if dtype == "float32" else 2)
    out = dict(unpack(p))
    assert list(out) == list(sd)
    tol = 0 if dtype == "float32" else 1e-2
    for k in sd:
        assert out[k].shape == sd[k].shape
        assert out[k].dtype == getattr(torch, dtype)
        torch.testing.assert_close(out[k].float(), sd[k], atol=tol, rtol=tol)
    # Read-only buffers (object-store views) unpack without a copy.
    p.buffer.setflags(write=False)
    assert dict(unpack(p))["b.bias"].shape == (5,)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pack_writes_into_the_previous_packs_buffer_when_it_fits(dtype):
    sd = {"a": torch.randn(3, 4), "b": torch.randn(5)}
    first = pack(sd, dtype, version=1)
    sd2 = {k: v + 1 for k, v in sd.items()}
    second = pack(sd2, dtype, version=2, out=first.buffer)
    assert second.buffer is first.buffer or np.shares_memory(second.buffer, first.buffer)
    tol = 0 if dtype == "float32" else 2e-2
    for k, v in unpack(second):
        torch.testing.assert_close(v.float(), sd2[k], atol=tol, rtol=tol)
    # A buffer of another size or dtype is not used: a fresh one is allocated.
    other = pack({"a": torch.randn(7)}, dtype, version=3, out=first.buffer)
    assert not np.shares_memory(other.buffer, first.buffer) and other.buffer.size == 7
    wrong = np.empty(first.buffer.size, dtype=np.float64)
    assert not np.shares_memory(pack(sd, dtype, version=4, out=wrong).buffer, wrong)
