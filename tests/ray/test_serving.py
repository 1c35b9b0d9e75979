"""The policy server on a real local Ray cluster: the real ``openai`` client against
``PolicyServer`` (``ray.serve.llm``'s vLLM engine host serving vLLM's OpenAI app with rayrlhf's
key, limits and routes), serving checkpoints a training run wrote;
best-of-n; an in-place switch to a newer checkpoint under load; API key and bad requests; a model
trained to call a tool returns ``tool_calls``, and the tool's answer reaches it as in training,
also through the Responses API driven by the OpenAI Agents SDK (run and streamed).
The same API, key, limits, best-of-n and reload checks then run against ``rayrlhf serve policy``
started as users start it, whose replica answers on its port itself (Serve's direct ingress)."""

import json
import threading
from pathlib import Path

import pytest
import requests
import torch

from cluster.config.loading import load_config
from cluster.driver import train

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]
KEY = "test-key-123"
PROMPT = "What is 12 + 7?"


@pytest.fixture(scope="module")
def checkpoints(ray_cluster, tmp_path_factory):
    """Two checkpoints of one short PPO run on the tiny model."""
    run = tmp_path_factory.mktemp("serve") / "run"
    train(
        load_config(
            ROOT / "configs" / "ppo_tiny.yaml",
            [
                "run.steps=2",
                "run.save_every=1",
                "run.keep_last=0",
                "run.eval_every=0",
                "run.plot=false",
                "rollout.prompts_per_step=8",
                "data.train_size=16",
                "data.eval_size=4",
            ],
        ),
        run_dir=run,
    )
    return run / "checkpoints" / "step_00001", run / "checkpoints" / "step_00002"


@pytest.fixture(scope="module")
def server(checkpoints, serve_url, monkeypatch_module):
    from ray import serve

    from serving.policy import build_policy_app

    monkeypatch_module.setenv("RAYRLHF_TEST_KEY", KEY)
    app = build_policy_app(
        {
            "model_path": str(checkpoints[0]),
            "dtype": "float32",
            "max_model_len": 640,
            "api_key_env": "RAYRLHF_TEST_KEY",
            "limits": {"max_n": 8, "max_tokens": 96},
            "best_of_n_scorer": {"function": "actors.rewards:digit_density"},
        }
    )
    serve.run(app, name="policy", route_prefix="/", blocking=False)
    url = serve_url
    from tests.conftest import wait_for

    wait_for(lambda: _ready(url), timeout=300, interval=2)
    yield url
    serve.delete("policy")


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _ready(url: str) -> bool:
    try:
        return (
            requests.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=5).status_code == 200
        )
    except requests.RequestException:
        return False


def _client(url: str):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)


def test_openai_client_completion_chat_and_stream(server):
    _answers_completion_chat_and_stream(server)


def _answers_completion_chat_and_stream(url: str) -> None:
    client = _client(url)
    assert [m.id for m in client.models.list().data] == ["policy"]
    comp = client.completions.create(model="policy", prompt="The answer is", max_tokens=8, temperature=0)
    assert comp.choices[0].text and comp.usage.completion_tokens >= 1
    chat = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": PROMPT}], max_tokens=8, temperature=0
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    chunks = list(
        client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": PROMPT}], max_tokens=8, temperature=0, stream=True
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) >= 2
    # Greedy: the stream spells out the same reply as the plain request.
    assert streamed == chat.choices[0].message.content


def test_the_server_leaves_no_usage_telemetry_actor_behind(server):
    """``ray.serve.llm`` starts a detached telemetry actor with each engine; rayrlhf's server does
    not (it outlives the application and wakes 100 times a second on the engine's cores)."""
    import ray

    named = {(a["namespace"], a["name"]) for a in ray.util.list_named_actors(all_namespaces=True)}
    assert not {n for n in named if "telemetry" in n[1]}, named
    assert any("SERVE_CONTROLLER" in name for _, name in named)  # the listing does show Serve's actors


def test_chat_with_tools_is_answered_through_the_tool_call_parser(server):
    """A request offering tools is served (vLLM's hermes parser reads the reply for calls, the
    format agents train with: tests/unit/test_tools.py); a reply without a call is plain content."""
    from actors.agents.tools import CALCULATOR

    client = _client(server)
    reply = client.chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": "What is 37 * 41?"}],
        tools=[CALCULATOR.schema()],
        max_tokens=8,
        temperature=0,
    )
    assert not reply.choices[0].message.tool_calls and reply.choices[0].message.content
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_best_of_n_returns_the_highest_scoring_sample(server):
    _best_of_n_returns_the_highest_scoring_sample(server)


def _best_of_n_returns_the_highest_scoring_sample(server: str) -> None:
    from actors.rewards.functions import digit_density

    # The tiny policy is peaked (p_max ~ 0.99): a high temperature makes the six samples differ.
    body = {"messages": [{"role": "user", "content": PROMPT}], "n": 6, "max_tokens": 16, "temperature": 2.0, "seed": 3}
    r = requests.post(f"{server}/v1/best_of_n", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    info = out["best_of_n"]
    assert len(info["candidates"]) == 6 and len(info["scores"]) == 6
    # The scorer's own scores for the same samples, computed here.
    mine = digit_density([PROMPT] * 6, info["candidates"])
    assert info["scores"] == pytest.approx(mine)
    assert mine[info["best_index"]] == max(mine)
    assert out["choices"][0]["message"]["content"] == info["candidates"][info["best_index"]]
    assert len(set(info["candidates"])) > 1  # really n samples (seed, seed+1, ...), not one repeated


def _served_logprobs(url: str) -> tuple[list[int], list[float]]:
    r = requests.post(
        f"{url}/v1/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=120,
        json={
            "model": "policy",
            "prompt": PROMPT,
            "max_tokens": 6,
            "temperature": 0,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    return [int(t.split(":")[1]) for t in lp["tokens"]], lp["token_logprobs"]


def _reference_logprobs(folder: Path, tokens: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    prompt = tok(PROMPT)["input_ids"]
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    return [float(logp[len(prompt) + i - 1, t]) for i, t in enumerate(tokens)]


def test_reload_switches_checkpoints_without_dropping_requests(server, checkpoints):
    _reload_switches_checkpoints_without_dropping_requests(server, checkpoints)


def _reload_switches_checkpoints_without_dropping_requests(server: str, checkpoints: tuple) -> None:
    tokens, before = _served_logprobs(server)
    assert before == pytest.approx(_reference_logprobs(checkpoints[0], tokens), abs=5e-3)
    statuses: list[int] = []
    stop = threading.Event()

    def load() -> None:  # chat requests all through the switch
        while not stop.is_set():
            r = requests.post(
                f"{server}/v1/chat/completions",
                headers={"Authorization": f"Bearer {KEY}"},
                timeout=120,
                json={"model": "policy", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16},
            )
            statuses.append(r.status_code)

    workers = [threading.Thread(target=load) for _ in range(3)]
    for w in workers:
        w.start()
    try:
        r = requests.post(
            f"{server}/v1/admin/reload",
            json={"model_path": str(checkpoints[1])},
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=300,
        )
    finally:
        stop.set()
        for w in workers:
            w.join()
    assert r.status_code == 200, r.text
    assert len(statuses) >= 3 and set(statuses) == {200}
    tokens, after = _served_logprobs(server)
    new, old = _reference_logprobs(checkpoints[1], tokens), _reference_logprobs(checkpoints[0], tokens)
    err_new = max(abs(a - b) for a, b in zip(after, new))
    err_old = max(abs(a - b) for a, b in zip(after, old))
    # The served log-probs are the new checkpoint's, and far from the old one's.
    assert err_new < 5e-3 and err_old > 5 * err_new + 1e-2, (err_new, err_old)
    served = requests.get(f"{server}/v1/admin/served", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
    assert served["model_path"] == str(checkpoints[1])


REFUSALS = [
    "no_key",
    "wrong_key",
    "bad_json",
    "max_tokens_neg",
    "max_tokens_huge",
    "n_huge",
    "unknown_model",
    "too_large",
    "reload_not_a_model",
]


@pytest.mark.parametrize("case", REFUSALS)
def test_refusals_are_clear_4xx(server, case):
    _refuses_with_a_clear_4xx(server, case)


def _refuses_with_a_clear_4xx(server: str, case: str) -> None:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    chat = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    path, expect, needle = "/v1/chat/completions", 400, ""
    if case == "no_key":
        headers.pop("Authorization")
        expect, needle = 401, "API key"
    elif case == "wrong_key":
        headers["Authorization"] = "Bearer nope"
        expect, needle = 401, "API key"
    elif case == "max_tokens_neg":
        chat["max_tokens"], needle = -1, "max_tokens"
    elif case == "max_tokens_huge":
        chat["max_tokens"], needle = 10**9, "max_tokens"
    elif case == "n_huge":
        chat["n"], needle = 1000, "n must be"
    elif case == "unknown_model":
        chat["model"], expect, needle = "gpt-17", 404, "gpt-17"
    elif case == "too_large":
        chat["messages"][0]["content"] = "x" * (2 << 20)
        expect, needle = 413, "limit"
    elif case == "reload_not_a_model":
        path, chat, needle = "/v1/admin/reload", {"model_path": "/nonexistent"}, "not a model folder"
    data = "{not json" if case == "bad_json" else json.dumps(chat)
    r = requests.post(f"{server}{path}", data=data, headers=headers, timeout=60)
    assert r.status_code == expect, r.text
    assert needle in r.json()["error"]["message"]


def test_a_trained_tool_caller_answers_with_tool_calls_and_reads_the_tool_answer(
    server, tiny_model_path, tmp_path_factory
):
    """The tiny model, taught one calculator conversation by the SFT learner, served after a
    reload: the real ``openai`` client gets ``tool_calls`` back, sends the tool's answer as a
    ``tool`` message, and gets the final answer. Each request's prompt is exactly the token ids
    training used (``actors/agents/episodes.py``), or the model would not continue as it learned."""
    from transformers import AutoTokenizer

    from actors.agents.chat_tokens import ChatTokens
    from tests.helpers.tool_agent import ANSWER, CALL, QUESTION, TOOLS, train_tool_caller

    folder, metrics = train_tool_caller(tiny_model_path, tmp_path_factory.mktemp("tool_caller") / "model")
    assert metrics["loss/total"] < 0.05
    r = requests.post(
        f"{server}/v1/admin/reload",
        json={"model_path": str(folder)},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    client = _client(server)
    messages = [{"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=96, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "37 * 41"}
    tok = AutoTokenizer.from_pretrained(folder)
    chat = ChatTokens(tok)
    trained_prompt = chat.prompt(QUESTION, TOOLS)
    assert first.usage.prompt_tokens == len(trained_prompt)
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": ANSWER},
    ]
    second = client.chat.completions.create(
        model="policy", messages=messages, tools=TOOLS, max_tokens=96, temperature=0
    )
    assert second.choices[0].message.content == ANSWER and not second.choices[0].message.tool_calls
    # The call as the model wrote it, the answer in the response tags, as the tool_use environment answers.
    reply = tok(CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    answer = chat.after_reply(
        [{"role": "tool", "content": f"<tool_response>\n{ANSWER}\n</tool_response>"}], reply_ended=True
    )
    assert second.usage.prompt_tokens == len(trained_prompt + reply + answer)


def test_the_agents_sdk_drives_a_served_tool_caller_through_the_responses_api(server, sdk_tool_caller):
    """The OpenAI Agents SDK with its default model (the Responses API), run and streamed,
    against the served agent: its function tool is called, the call's output reaches the model
    in the format it trained with (tool calls as the text it wrote, outputs inside the response
    tags), and it answers; a reply carries the sampled ids; a bad request is a 400 naming the field."""
    import asyncio

    from agents import Agent, ModelSettings, RunConfig, Runner, set_tracing_disabled
    from agents.models.openai_provider import OpenAIProvider
    from openai import AsyncOpenAI

    from tests.helpers.sdk_agents import INSTRUCTIONS, sdk_tool
    from tests.helpers.tool_agent import ANSWER, QUESTION

    r = requests.post(
        f"{server}/v1/admin/reload",
        json={"model_path": sdk_tool_caller},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    set_tracing_disabled(True)
    agent = Agent(
        name="calculator",
        instructions=INSTRUCTIONS,
        tools=[sdk_tool()],
        model="policy",
        model_settings=ModelSettings(temperature=0.0),
    )
    config = RunConfig(
        model_provider=OpenAIProvider(openai_client=AsyncOpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)),
        tracing_disabled=True,
    )

    async def both():  # one event loop: the client's connections belong to it
        plain = await Runner.run(agent, QUESTION, run_config=config, max_turns=3)
        streamed = Runner.run_streamed(agent, QUESTION, run_config=config, max_turns=3)
        async for _ in streamed.stream_events():
            pass
        return plain, streamed

    for result in asyncio.run(both()):
        assert result.final_output == ANSWER
        calls = [i for i in result.new_items if i.type == "tool_call_item"]
        outputs = [i for i in result.new_items if i.type == "tool_call_output_item"]
        assert len(calls) == 1 and json.loads(calls[0].raw_item.arguments) == {"expression": "37 * 41"}
        assert outputs[0].output == ANSWER
    headers = {"Authorization": f"Bearer {KEY}"}
    reply = requests.post(
        f"{server}/v1/responses",
        json={"model": "policy", "input": QUESTION, "max_output_tokens": 8},
        headers=headers,
        timeout=120,
    ).json()
    assert len(reply["token_ids"]) == reply["usage"]["output_tokens"] > 0 and reply["output"][0]["type"] == "message"
    bad = requests.post(
        f"{server}/v1/responses", json={"model": "policy", "input": [{"type": "image"}]}, headers=headers, timeout=60
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input[0].type"
    assert (
        requests.post(f"{server}/v1/responses", json={"model": "policy", "input": "x"}, timeout=60).status_code == 401
    )


def _listener(port: int):
    """The process listening on 127.0.0.1:``port``."""
    import psutil

    pids = {c.pid for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
    assert len(pids) == 1, pids
    return psutil.Process(pids.pop())


def test_the_server_as_users_start_it_is_answered_by_its_replica_on_its_own_port(checkpoints, tmp_path):
    """``rayrlhf serve policy`` in a process of its own, on its own cluster, one replica (how users
    and the benchmark start it): the replica itself listens on ``--port`` (Serve's direct ingress:
    one hop per request instead of three actor calls through the proxy, which listens on another
    port), and the API, key, limits, best-of-n and reload hold there as through the proxy. SIGTERM
    then stops it: exit status 0, the port free, the replica and its engine processes gone."""
    import os
    import re
    import signal
    import subprocess
    import sys

    import psutil

    from serving.common import port_is_free
    from serving.common import free_port
    from tests.conftest import wait_for

    port = free_port()
    url, log = f"http://127.0.0.1:{port}", tmp_path / "server.log"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAYRLHF_TEST_KEY": KEY}
    cmd = [
        sys.executable,
        "-m",
        "cluster.cli",
        "serve",
        "policy",
        str(checkpoints[0]),
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "640",
        "--api-key-env",
        "RAYRLHF_TEST_KEY",
        "--max-n",
        "8",
        "--max-tokens",
        "96",
        "--best-of-n-scorer",
        "actors.rewards:digit_density",
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # Up once it says so (after Serve reports the app running) and answers.
        wait_for(
            lambda: proc.poll() is not None or ("[rayrlhf] policy server on" in log.read_text() and _ready(url)),
            timeout=300,
            interval=2,
        )
        assert proc.poll() is None, log.read_text()[-3000:]
        replica = _listener(port)
        assert replica.name().startswith("ray::ServeReplica:policy:PolicyServer"), replica.name()
        proxy_port = int(re.search(r"Serve's proxy on port (\d+)", log.read_text()).group(1))
        assert proxy_port != port and _listener(proxy_port).name() == "ray::ProxyActor"
        engine = replica.children(recursive=True)
        assert any("VLLM" in p.name() for p in engine), [p.name() for p in engine]
        _answers_completion_chat_and_stream(url)
        _best_of_n_returns_the_highest_scoring_sample(url)
        for case in REFUSALS:
            _refuses_with_a_clear_4xx(url, case)
        _reload_switches_checkpoints_without_dropping_requests(url, checkpoints)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=180) == 0, log.read_text()[-3000:]
        assert port_is_free("127.0.0.1", port)
        assert not [p for p in [replica, *engine] if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
