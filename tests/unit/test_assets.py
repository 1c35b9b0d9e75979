import json

from cluster.assets import build_tiny, resolve_model


def test_tiny_asset_is_built_once_and_rebuilt_when_corrupt(tmp_path):
    folder = build_tiny(tmp_path)
    marker = json.loads((folder / "rayrlhf_asset.json").read_text())
    assert marker["parameters"] > 100_000 and (folder / "model.safetensors").is_file()
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    assert build_tiny(tmp_path) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not rebuilt
    # A truncated weight file (a killed build, a bad copy) is detected and rebuilt.
    with open(folder / "model.safetensors", "r+b") as fh:
        fh.truncate(100)
    build_tiny(tmp_path)
    assert (folder / "model.safetensors").stat().st_size == marker["files"]["model.safetensors"]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok.apply_chat_template([{"role": "user", "content": "2+2?"}], add_generation_prompt=True, tokenize=True)[
        "input_ids"
    ]
    assert tok.eos_token == "<|im_end|>" and len(ids) > 3
    assert AutoModelForCausalLM.from_pretrained(folder).config.tie_word_embeddings


def test_resolve_model_errors_name_the_choices(tmp_path):
    import pytest

    with pytest.raises(FileNotFoundError, match="built-in asset"):
        resolve_model(str(tmp_path / "nope"))
