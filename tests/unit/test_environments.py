"""The environment interface and the built-in environments, at the level of text: the guessing
game, try-again feedback, tool use (tool answers as observations, the final answer verified), and the forms a user's
step may return (OpenEnv servers: tests/unit/test_openenv_sessions.py)."""

import pytest

from actors.agents.env_step import Step, as_step
from actors.agents.environments import EnvSpec, Feedback, GuessNumber, ToolUse, environment_factory, verifier
from actors.rewards.functions import exact_match
from actors.agents.tools import CALCULATOR, ToolBox

ROW = {"prompt": "What is 6 * 7?", "answer": "42", "meta": {"answer": "42"}}


def test_guess_number_answers_higher_lower_and_rewards_a_hit_within_the_budget():
    rows = GuessNumber.make_rows(20, seed=3, low=1, high=8, max_guesses=3)
    assert rows == GuessNumber.make_rows(20, seed=3, low=1, high=8, max_guesses=3)
    assert all(1 <= int(r["answer"]) <= 8 for r in rows) and "3 guesses" in rows[0]["prompt"]
    env = GuessNumber(1, 8, max_guesses=3)
    env.reset({"prompt": "p", "answer": "5"})
    assert env.step("I guess 2") == Step("Higher.", 0.0, False, {})
    assert env.step("7") == Step("Lower.", 0.0, False, {})
    assert env.step("5") == Step(None, 1.0, True, {"guesses": 3})
    env.reset({"prompt": "p", "answer": "5"})
    assert env.step("no idea").observation == "Reply with one number."
    env.step("1")
    assert env.step("2") == Step(None, 0.0, True, {"guesses": 3})  # out of guesses


def test_feedback_discounts_each_retry_and_gives_up_after_its_attempts():
    check = lambda row: verifier(exact_match, row)  # noqa: E731
    env = Feedback(check, attempts=3, discount=0.5)
    assert env.reset(ROW) == ROW["prompt"]
    assert env.step("41") == Step("Incorrect, try again.", 0.0, False, {})
    assert env.step("The answer is 42") == Step(None, 0.5, True, {"attempts": 2})
    env.reset(ROW)
    assert [env.step("0").done for _ in range(3)] == [False, False, True]


def test_tool_use_answers_calls_with_tool_messages_and_verifies_the_final_answer():
    env = ToolUse(lambda row: verifier(exact_match, row), ToolBox([CALCULATOR]), max_tool_calls=2)
    env.reset(ROW)
    assert env.tools[0]["function"]["name"] == "calculator"
    step = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>')
    assert step.observation == {"role": "tool", "content": "<tool_response>\n42\n</tool_response>"} and not step.done
    step = env.step("<tool_call>{oops}</tool_call>")
    assert "malformed" in step.observation["content"] and step.info["tool_calls"] == {"ok": 1, "malformed": 1}
    assert env.step("The answer is 42") == Step(None, 1.0, True, {"tool_calls": {"ok": 1, "malformed": 1}})
    env.reset(ROW)
    env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>' * 3)
    # A third call is over the limit: the episode ends unanswered.
    assert env.counts == {"ok": 2, "over_limit": 1}


def test_a_step_may_return_gymnasium_tuples_or_a_dict_and_garbage_is_an_error():
    assert as_step(("o", 1, False, {})) == Step("o", 1.0, False, {})
    assert as_step(("o", 0.5, False, True, {"k": 1})) == Step("o", 0.5, True, {"k": 1})
    assert as_step({"observation": "o", "reward": None, "done": 1}) == Step("o", 0.0, True, {})
    for garbage in ("text", None, (1, 2)):
        with pytest.raises(TypeError):
            as_step(garbage)


def test_environment_factory_builds_each_kind_and_names_a_bad_one():
    assert isinstance(environment_factory(EnvSpec("guess_number", {"high": 4}))(), GuessNumber)
    assert isinstance(environment_factory(EnvSpec("feedback", verifier="exact_match"))(), Feedback)
    env = environment_factory(EnvSpec("tool_use", tools=["calculator", "python"], verifier="exact_match"))()
    assert [t["function"]["name"] for t in env.tools] == ["calculator", "python"]
    assert isinstance(environment_factory(EnvSpec("tests.helpers.environments:DigitsAcrossTurns"))(), object)
    for bad in ("nope", "no_such_module:Env", "actors.agents.tools:missing"):
        with pytest.raises(ValueError, match="environment"):
            environment_factory(EnvSpec(bad))


def test_a_built_in_environment_is_one_decorated_builder():
    from actors.agents import environments

    @environments.register_environment("countdown")
    def _countdown(spec):
        return lambda: GuessNumber(**spec.args)

    try:
        assert isinstance(environment_factory(EnvSpec("countdown", {"high": 2}))(), GuessNumber)
        with pytest.raises(ValueError, match="already registered"):
            environments.register_environment("countdown")(_countdown)
        with pytest.raises(ValueError, match=r"neither a built-in \(guess_number, feedback, tool_use, countdown\)"):
            environment_factory(EnvSpec("nope"))
    finally:
        del environments.ENVIRONMENTS["countdown"]
