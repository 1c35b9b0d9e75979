"""A multi-turn verifiers environment: the model answers, hears "Again." twice (the ``Env``
drives the seat's interaction turn by turn, as the package's own user-simulation environment
does), and the rubric scores the episode: ``digits`` (the digit density of the first reply, a
reward a random tiny model can learn) and ``every_turn`` (replies that said something), with a
``turns`` metric."""

from __future__ import annotations

import verifiers.v1 as vf

from actors.rewards.functions import digit_density

FOLLOW_UPS = ["Again.", "Once more."]


class TurnsData(vf.TaskData):
    answer: str = ""


class TurnsTask(vf.Task[TurnsData]):
    @vf.reward(weight=1.0)
    async def digits(self, trace: vf.Trace) -> float:
        replies = trace.assistant_messages
        return digit_density([""], [replies[0].content or ""])[0] if replies else 0.0

    @vf.reward(weight=0.5)
    async def every_turn(self, trace: vf.Trace) -> float:
        replies = trace.assistant_messages
        return sum(bool((m.content or "").strip()) for m in replies) / max(len(replies), 1)

    @vf.metric
    async def turns(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class TurnsConfig(vf.TasksetConfig):
    num_tasks: int = 16


class TurnsTaskset(vf.Taskset[TurnsTask, TurnsConfig]):
    def load(self):
        for i in range(self.config.num_tasks):
            yield TurnsTask(
                TurnsData(id=f"turns-{i}", prompt=[{"role": "user", "content": f"Count from {i}."}], answer=str(i)),
                self.config.task,
            )


class TurnsEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()  # the one seat, named agent


class TurnsEnv(vf.Env[TurnsEnvConfig]):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            segment = await chat.turn()
            for message in FOLLOW_UPS:
                if segment.terminated:
                    break
                segment = await chat.turn(message)


__all__ = ["TurnsTaskset", "TurnsEnv"]
