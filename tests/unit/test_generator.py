"""The plain Generator class (a real in-process vLLM engine), without Ray."""

import os
import time

import pytest
import torch


ENGINE_MAX_MODEL_LEN = 96  # the `generator` fixture's engine (tests/conftest.py)


def test_generate_builds_a_valid_record_and_counts_skips(generator):
    prompts = ["What is 2 + 2?", "", "word " * 200, "Name a number."]
    exp = generator.generate(
        prompts, [{"i": i} for i in range(4)], [10, 11, 12, 13], max_new_tokens=12, max_prompt_tokens=64, n=3
    )
    assert exp.skipped["empty_prompt"] == 1 and exp.skipped["prompt_too_long"] == 1
    assert exp.batch_size == 6  # 2 usable prompts x 3 samples, groups kept together
    assert exp.group_ids.tolist() == [10, 10, 10, 13, 13, 13]
    assert [m["i"] for m in exp.meta] == [0, 0, 0, 3, 3, 3]
    lengths = exp.response_lengths()
    assert (lengths >= 1).all() and (lengths <= 12).all()
    # A response that never emitted EOS within the limit is flagged as truncated.
    assert exp.truncated.tolist() == (lengths == 12).tolist()
    assert exp.skipped["truncated"] == int(exp.truncated.sum())
    lp = exp.rollout_logprobs
    assert (lp[exp.response_mask] <= 0).all() and (lp[~exp.response_mask] == 0).all()
    # The prompt part of each row is the chat-templated prompt.
    first = exp.input_ids[0][exp.attention_mask[0] & ~exp.response_mask[0]].tolist()
    assert first == generator.encode_prompt("What is 2 + 2?")


def test_all_prompts_unusable_is_a_clear_error(generator):
    with pytest.raises(ValueError, match="no usable prompt"):
        generator.generate(["", "   "], max_new_tokens=4)


def test_greedy_is_deterministic(generator):
    a = generator.generate(["Count: 1 2 3"], max_new_tokens=10, temperature=0.0)
    b = generator.generate(["Count: 1 2 3"], max_new_tokens=10, temperature=0.0)
    assert torch.equal(a.input_ids, b.input_ids)


def test_top_k_of_one_samples_the_greedy_reply(generator):
    prompts = ["Count to five.", "Name a colour."]
    greedy = generator.generate(prompts, max_new_tokens=8, temperature=0.0)
    top1 = generator.generate(prompts, max_new_tokens=8, temperature=1.5, top_k=1, n=2, seed=3)
    hot = generator.generate(prompts, max_new_tokens=8, temperature=1.5, n=2, seed=3)
    assert top1.completions == [c for c in greedy.completions for _ in range(2)]
    assert hot.completions != top1.completions


def test_a_seeded_call_samples_reproducibly(generator):
    """The same seed gives the same samples (what makes a resumed run sample as the uninterrupted
    one did); another seed gives others."""
    prompts = ["Say something.", "Name three numbers."]
    kw = dict(max_new_tokens=12, temperature=1.0, n=4)
    a = generator.generate(prompts, seed=123, **kw)
    generator.generate(prompts, **kw)  # the engine's own generator moves on in between
    b = generator.generate(prompts, seed=123, **kw)
    c = generator.generate(prompts, seed=124, **kw)
    assert torch.equal(a.input_ids, b.input_ids)
    assert a.completions == b.completions and a.completions != c.completions


@pytest.mark.parametrize(
    "threads,first_core,cores,bind",
    [
        (0, 0, 2, "0-1"),  # one generator: every core
        (1, 0, 2, "0"),  # a pool of two with one thread each: generator 0 on core 0 ...
        (1, 1, 2, "1"),  # ... and generator 1 on core 1
        (2, 2, 8, "2-3"),
        (2, 8, 8, "0-1"),  # wrapped to the node's cores
        (4, 6, 8, "0-3"),  # would run past the last core: starts again at 0
        (16, 0, 8, "0-7"),  # more threads than cores: every core once
    ],
)
def test_generators_sharing_a_node_bind_their_threads_to_different_cores(monkeypatch, threads, first_core, cores, bind):
    from actors.rollout.generator import configure_vllm_env

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: cores)
    torch_threads = []
    monkeypatch.setattr("torch.set_num_threads", torch_threads.append)
    configure_vllm_env(1, threads, first_core)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == bind
    # An engine with a share of the cores caps every OpenMP pool of its process at that share
    # (left at the core count, two 1-thread engines on a node ran 7x slower each).
    n = min(threads, cores)
    assert os.environ.get("OMP_NUM_THREADS") == (str(n) if threads else None)
    assert torch_threads == ([n] if threads else [])


def test_a_weight_load_lands_between_decoding_steps_and_each_token_records_its_version(generator, tiny_model_path):
    """In-flight weight update (``rollout.inflight_updates``): a load from another thread lands
    in a running generation. Tokens sampled after it carry the new version and the new weights'
    log-probs (the running sequences recomputed their KV cache); a probe sent meanwhile rides
    along in the running loop."""
    import threading

    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    original = {k: v.clone() for k, v in lm.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    new = {k: v + 3 * v.std() * torch.randn(v.shape, generator=g) if v.dim() == 2 else v for k, v in original.items()}
    v0 = generator.version
    steps = []
    engine = generator.llm.llm_engine
    real_step = engine.step
    at_step_5 = threading.Event()

    def step():
        # The order of events, not timing: at its 5th step the generation waits (a minute at
        # most) until the load below is waiting for the engine, so the load lands right after it.
        steps.append(1)
        if len(steps) == 5:
            at_step_5.set()
            deadline = time.time() + 60
            while not generator.loop._waiting and time.time() < deadline:
                time.sleep(0.001)
        return real_step()

    engine.step = step
    loaded_at = []  # the engine step count when the load ran
    real_load = generator._load
    generator._load = lambda named, version: (loaded_at.append(len(steps)), real_load(named, version))[1]
    prompts = [f"Count from {i}:" for i in range(8)]
    out = {}
    worker = threading.Thread(
        target=lambda: out.update(
            exp=generator.generate(prompts, max_new_tokens=60, ignore_eos=True, temperature=1.0, n=2, seed=5)
        )
    )
    probe_ids = generator.encode_prompt("What is 3 + 4? The answer is 7.")
    try:
        worker.start()
        assert at_step_5.wait(timeout=120)
        generator.load_weights(new.items(), v0 + 1)
        ridden = generator.probe_logprobs(probe_ids)
        probe_done_at = len(steps)
        worker.join(timeout=120)
        total = len(steps)
        assert not worker.is_alive()
        exp = out["exp"]
        # The load landed mid-generation, right after the 5th step, not before or after it.
        assert loaded_at == [5] and total > 50 and generator.inflight_loads == 1
        assert exp.policy_version == v0 and exp.token_versions is not None  # the oldest tokens' version
        for row in range(exp.batch_size):
            vs = exp.token_versions[row][exp.response_mask[row]]
            assert len(vs) == 60 and vs[0] == v0 and vs[-1] == v0 + 1
            assert bool((vs[1:] >= vs[:-1]).all())  # one switch, old weights then new
        # The probe finished while the generation still had steps to run: it rode along.
        assert probe_done_at < total
        assert ridden == pytest.approx(generator.probe_logprobs(probe_ids), abs=1e-4)
        # Teacher-forced under the new weights, the tokens sampled after the load have the log-probs
        # the engine reported for them; those sampled before do not.
        new_gap, old_gap = [], []
        for row in range(exp.batch_size):
            ids = exp.input_ids[row][exp.attention_mask[row]].tolist()
            forced = torch.tensor(generator.probe_logprobs(ids))[-60:]
            mask = exp.response_mask[row]
            rolled, vs = exp.rollout_logprobs[row][mask], exp.token_versions[row][mask]
            new_gap.append((forced - rolled)[vs == v0 + 1].abs())
            old_gap.append((forced - rolled)[vs == v0].abs())
        # (fp32 engine: exact here, 0.0; the random tiny model's distributions are flat, so the
        # old weights' tokens differ by ~0.008 nats only.)
        assert float(torch.cat(new_gap).max()) < 1e-4
        assert float(torch.cat(old_gap).mean()) > 2e-3
    finally:
        worker.join(timeout=120)
        engine.step = real_step
        del generator._load
        generator.load_weights(original.items(), v0)


def test_an_adapter_sync_serves_what_a_merged_sync_serves(generator, tiny_model_path):
    """``lora.sync: adapter``: the engine receives LoRA factors only (on q and v, which vLLM fuses
    with k into one layer), merges them into the base weights it reads from the base model folder,
    and serves the log-probs it serves after receiving the merged weights themselves."""
    from transformers import AutoModelForCausalLM

    from learners.training.lora_sync import adapter_factors
    from tests.helpers.factories import trained_lora

    original = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).state_dict()
    model = trained_lora(tiny_model_path, ["q_proj", "v_proj"], scale=0.2, seed=1)
    factors = adapter_factors(model)
    probe = generator.encode_prompt("What is 3 + 4? The answer is 7.")
    base_lps = generator.probe_logprobs(probe)
    generator.lora_base, v0 = tiny_model_path, generator.version
    try:
        generator.load_weights(factors.items(), v0 + 1)
        from_adapter = generator.probe_logprobs(probe)
        generator.load_weights(model.merge_and_unload().state_dict().items(), v0 + 2)
        from_merged = generator.probe_logprobs(probe)
    finally:
        generator.load_weights(original.items(), v0)
        generator.lora_base = ""
    assert from_adapter == pytest.approx(from_merged, abs=1e-5)
    assert max(abs(a - b) for a, b in zip(from_adapter, base_lps)) > 1e-2  # the adapter changed what it serves
    assert generator.probe_logprobs(probe) == pytest.approx(base_lps, abs=1e-5)
    # Without a base model folder an adapter sync is refused, not loaded half-way.
    with pytest.raises(ValueError, match="without lora_base"):
        generator.load_weights(factors.items(), v0 + 3)
