"""The Tinker service (``rayrlhf serve trainer``) on a real local Ray cluster, driven by the real
``tinker`` SDK as users drive it against Thinking Machines' own service: a LoRA training client
on the tiny model learns a fixed batch, saves its weights for the sampler and samples from them
(vLLM with the tenant's adapter); two tenants trained at once end as each trained alone; bad
requests get the SDK's errors."""

import json

import numpy as np
import pytest
import requests
import torch

pytestmark = pytest.mark.ray
KEY = "tml-rayrlhf-test-key"
LR = 1e-2


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def trainer_url(serve_url, tiny_model_path, tmp_path_factory, monkeypatch_module):
    from ray import serve

    from serving.tinker.app import build_trainer_app

    from cluster.assets import resolve_model

    store = tmp_path_factory.mktemp("tinker-store")
    monkeypatch_module.setenv("RAYRLHF_TINKER_TEST_KEY", KEY)
    monkeypatch_module.setenv("TINKER_TELEMETRY", "0")
    models = {"tiny": tiny_model_path, "smollm2-135m": resolve_model("smollm2-135m")}
    try:
        serve.run(build_trainer_app(_settings(models, store)), name="trainer", route_prefix="/")
        yield serve_url, store
    finally:
        serve.delete("trainer")


def _settings(models: dict, store) -> dict:
    limits = {"max_model_len": 256, "max_tokens": 64, "max_rank": 16, "max_adapters": 16}
    return {"models": models, "store": str(store), "api_key_env": "RAYRLHF_TINKER_TEST_KEY", **limits}


def _batch(seed: int) -> list:
    import tinker

    g = torch.Generator().manual_seed(seed)
    data = []
    for n in (9, 6):
        tokens = torch.randint(3, 500, (n + 1,), generator=g).tolist()
        data.append(
            tinker.Datum(
                model_input=tinker.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": np.array(tokens[1:]), "weights": np.ones(n, dtype=np.float32)},
            )
        )
    return data


def _train(tc, data, steps: int) -> list[float]:
    import tinker

    losses = []
    for _ in range(steps):
        fb = tc.forward_backward(data, "cross_entropy")
        step = tc.optim_step(tinker.AdamParams(learning_rate=LR))
        losses.append(fb.result().metrics["loss:sum"])
        step.result()
    return losses


def _adapter(store, path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    model_id, kind, name = path[len("tinker://") :].split("/")
    return load_file(str(store / model_id / kind / name / "adapter_model.safetensors"))


def test_the_sdk_trains_an_adapter_and_samples_it_with_the_trainers_logprobs(trainer_url):
    import tinker

    url, store = trainer_url
    service = tinker.ServiceClient(base_url=url, api_key=KEY)
    tc = service.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    assert tc.get_info().model_data.model_name == "tiny"
    losses = _train(tc, _batch(0), 4)
    assert all(b < a for a, b in zip(losses, losses[1:])), losses

    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = [5, 17, 42, 99]
    params = tinker.SamplingParams(max_tokens=12, temperature=1.0, seed=3, stop=[])
    result = sampler.sample(tinker.ModelInput.from_ints(prompt), num_samples=2, sampling_params=params).result()
    assert len(result.sequences) == 2 and all(len(s.tokens) == 12 for s in result.sequences)
    for seq in result.sequences:
        # The trainer's own forward pass (transformers + peft) scores the engine's sample.
        tokens = prompt + list(seq.tokens)
        datum = tinker.Datum(
            model_input=tinker.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": np.array(tokens[1:])}
        )
        out = tc.forward([datum], "cross_entropy").result()
        trained = out.loss_fn_outputs[0]["logprobs"].to_numpy()[len(prompt) - 1 :]
        np.testing.assert_allclose(np.array(seq.logprobs), trained, atol=2e-3, rtol=0)

    # A named sampler checkpoint is a peft adapter folder vLLM and transformers load as it is.
    path = tc.save_weights_for_sampler("final").result().path
    assert path == f"tinker://{tc.model_id}/sampler_weights/final"
    config = json.loads((store / tc.model_id / "sampler_weights" / "final" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["peft_type"] == "LORA"


def test_the_docs_example_trains_smollm2_and_samples_what_it_learned(trainer_url, monkeypatch, capsys):
    """docs/tinker.md's client example, run as written, against SmolLM2-135M-Instruct."""
    import re
    from pathlib import Path

    url, _ = trainer_url
    page = (Path(__file__).resolve().parents[2] / "docs" / "tinker.md").read_text()
    example = re.search(r"```python\n(.*?)```", page, flags=re.S).group(1)
    monkeypatch.setenv("TINKER_BASE_URL", url)
    monkeypatch.setenv("TINKER_API_KEY", KEY)
    namespace: dict = {}
    exec(compile(example, "docs/tinker.md", "exec"), namespace)
    losses = [float(line.split()[1]) for line in capsys.readouterr().out.splitlines() if re.match(r"^\d \S+$", line)]
    assert len(losses) == 5 and losses[-1] < losses[0] / 2, losses
    assert len(namespace["out"].sequences) == 2
    # The adapter learned the sentence: the sample continues the prompt with it.
    assert any(namespace["tok"].decode(s.tokens).startswith(" France is Paris") for s in namespace["out"].sequences)


def test_two_tenants_trained_at_once_end_as_each_trained_alone(trainer_url):
    import tinker

    url, store = trainer_url
    service = tinker.ServiceClient(base_url=url, api_key=KEY)
    alone = service.create_lora_training_client(base_model="tiny", rank=4, seed=7).result()
    _train(alone, _batch(1), 3)
    alone_path = alone.save_state("alone").result().path

    a = service.create_lora_training_client(base_model="tiny", rank=4, seed=7).result()
    b = service.create_lora_training_client(base_model="tiny", rank=8, seed=8, train_mlp=False).result()
    for _ in range(3):  # interleaved on the same learner: a's and b's calls alternate
        fa = a.forward_backward(_batch(1), "cross_entropy")
        fb = b.forward_backward(_batch(2), "cross_entropy")
        sb, sa = b.optim_step(tinker.AdamParams(learning_rate=LR)), a.optim_step(tinker.AdamParams(learning_rate=LR))
        for f in (fa, fb, sa, sb):
            f.result()
    a_path, b_path = a.save_state("a").result().path, b.save_state("b").result().path
    want, got = _adapter(store, alone_path), _adapter(store, a_path)
    assert sorted(want) == sorted(got)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
    assert _adapter(store, b_path).keys() != want.keys()  # b's own targets (no MLP) and rank

    # A client made from the saved state (optimizer included) continues as the one that saved it.
    loaded = service.create_training_client_from_state_with_optimizer(alone_path).result()
    _train(alone, _batch(3), 1)
    _train(loaded, _batch(3), 1)
    want, got = (
        _adapter(store, alone.save_state("alone-4").result().path),
        _adapter(store, loaded.save_state("l").result().path),
    )
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)


def test_forward_backward_custom_with_cross_entropys_loss_takes_cross_entropys_step(trainer_url):
    import tinker

    url, store = trainer_url
    service = tinker.ServiceClient(base_url=url, api_key=KEY)
    plain = service.create_lora_training_client(base_model="tiny", rank=4, seed=21).result()
    custom = service.create_lora_training_client(base_model="tiny", rank=4, seed=21).result()

    def nll(data, logprobs):  # the SDK runs this on the client, between its two server calls
        loss = sum(-(lp * torch.tensor(d.loss_fn_inputs["weights"].to_numpy())).sum() for d, lp in zip(data, logprobs))
        return loss, {"nll": float(loss)}

    for _ in range(2):
        want = plain.forward_backward(_batch(4), "cross_entropy").result().metrics["loss:sum"]
        got = custom.forward_backward_custom(_batch(4), nll).result().metrics
        assert got["loss:sum"] == pytest.approx(want, rel=1e-5)
        plain.optim_step(tinker.AdamParams(learning_rate=LR)).result()
        custom.optim_step(tinker.AdamParams(learning_rate=LR)).result()
    want = _adapter(store, plain.save_state("plain").result().path)
    got = _adapter(store, custom.save_state("custom").result().path)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_bad_requests_get_the_sdks_errors(trainer_url):
    import tinker

    url, _ = trainer_url
    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient(base_url=url, api_key="tml-wrong").create_lora_training_client(
            base_model="tiny", rank=4
        ).result()
    service = tinker.ServiceClient(base_url=url, api_key=KEY)
    with pytest.raises(tinker.BadRequestError, match="unknown base_model"):
        service.create_lora_training_client(base_model="no-such-model", rank=4).result()
    tc = service.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    with pytest.raises(tinker.RequestFailedError, match="unknown loss_fn") as e:
        tc.forward_backward(_batch(0), "no_such_loss").result()
    assert e.value.category == "user" and "ray::" not in str(e.value)  # the role's own message, not Ray's wrapping
    short = tinker.Datum(
        model_input=tinker.ModelInput.from_ints([5, 6, 7]), loss_fn_inputs={"target_tokens": np.array([1, 2])}
    )
    with pytest.raises(tinker.RequestFailedError, match="target_tokens has shape"):
        tc.forward_backward([short], "cross_entropy").result()
    # The tenant's state survived its bad requests: it still trains.
    losses = _train(tc, _batch(0), 2)
    assert losses[1] < losses[0]
    r = requests.post(
        url + "/api/v1/optim_step", json={"model_id": "nobody:train:0", "seq_id": 1}, headers={"X-API-Key": KEY}
    )
    assert r.status_code == 400 and "unknown model_id" in r.json()["error"]


def _kill_role(role: str, base: str = "tiny") -> None:
    """SIGKILLs the service's live ``tinker-<role>:<base>:...`` actor (named in serving/tinker/app.py)
    and waits for the GCS to record its death."""
    import os
    import signal

    from tests.conftest import wait_for
    from tests.helpers.kills import alive_actors

    prefix = f"tinker-{role}:{base}:"
    actors = alive_actors(lambda a: a["Name"].startswith(prefix))
    assert len(actors) == 1, actors
    os.kill(int(actors[0]["Pid"]), signal.SIGKILL)
    gone = actors[0]["ActorID"]
    wait_for(lambda: not alive_actors(lambda a: a["ActorID"] == gone), 120, describe=lambda: actors)


def test_a_dead_sampler_is_replaced_and_a_dead_trainer_fails_its_clients_with_a_clear_error(trainer_url):
    import tinker

    url, _ = trainer_url
    service = tinker.ServiceClient(base_url=url, api_key=KEY)
    tc = service.create_lora_training_client(base_model="tiny", rank=4, seed=41).result()
    _train(tc, _batch(7), 1)
    sampler = tc.save_weights_and_get_sampling_client().result()
    _kill_role("sampler")
    # A sample changes nothing: the fresh engine takes it again, and the future completes.
    params = tinker.SamplingParams(max_tokens=6, seed=1, stop=[])
    out = sampler.sample(tinker.ModelInput.from_ints([3, 4, 5]), 2, params).result()
    assert [len(s.tokens) for s in out.sequences] == [6, 6]

    state = tc.save_state("before-the-kill").result().path
    _kill_role("trainer")
    with pytest.raises(tinker.RequestFailedError, match="trainer of base model 'tiny' died") as e:
        tc.forward_backward(_batch(7), "cross_entropy").result()
    assert e.value.category == "server"
    with pytest.raises(tinker.BadRequestError, match="is gone: the trainer of 'tiny' died"):
        tc.optim_step(tinker.AdamParams(learning_rate=LR)).result()
    # The fresh trainer serves new clients, and the saved state comes back whole.
    loaded = service.create_training_client_from_state_with_optimizer(state).result()
    losses = _train(loaded, _batch(7), 2)
    assert losses[1] < losses[0]


def test_a_restarted_service_serves_the_saved_states_from_its_store(trainer_url, tiny_model_path):
    """Runs last: it replaces the module's service with a new one on the same store."""
    import tinker
    from ray import serve

    from serving.tinker.app import build_trainer_app

    url, store = trainer_url
    probe = _batch(6)
    with tinker.ServiceClient(base_url=url, api_key=KEY) as first:  # leaving it finishes the session
        tc = first.create_lora_training_client(base_model="tiny", rank=4, seed=31).result()
        _train(tc, _batch(5), 2)
        state, sampler_path = tc.save_state("kept").result().path, tc.save_weights_for_sampler("kept").result().path
        before = [o["logprobs"].to_numpy() for o in tc.forward(probe, "cross_entropy").result().loss_fn_outputs]

    serve.delete("trainer")  # the service's processes are gone; its store is not
    serve.run(build_trainer_app(_settings({"tiny": tiny_model_path}, store)), name="trainer", route_prefix="/")
    service = tinker.ServiceClient(base_url=url, api_key=KEY)
    loaded = service.create_training_client_from_state_with_optimizer(state).result()
    after = [o["logprobs"].to_numpy() for o in loaded.forward(probe, "cross_entropy").result().loss_fn_outputs]
    for b, a in zip(before, after):
        np.testing.assert_array_equal(a, b)
    sampler = service.create_sampling_client(model_path=sampler_path).result()
    prompt = [7, 8, 9]
    seq = (
        sampler.sample(tinker.ModelInput.from_ints(prompt), 1, tinker.SamplingParams(max_tokens=8, seed=4, stop=[]))
        .result()
        .sequences[0]
    )
    tokens = prompt + list(seq.tokens)
    datum = tinker.Datum(
        model_input=tinker.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": np.array(tokens[1:])}
    )
    scored = loaded.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_allclose(np.array(seq.logprobs), scored[len(prompt) - 1 :], atol=2e-3, rtol=0)
