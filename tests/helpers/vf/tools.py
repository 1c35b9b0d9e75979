"""A tool-use verifiers environment: a calculator served as an MCP toolset (``toolset.py``, run
by the package as ``python -m``), called by the seat's harness; the rubric scores the answer
(``correct``) and the use of the tool (``used_tool``)."""

from __future__ import annotations

import verifiers.v1 as vf

from tests.helpers.vf.toolset import CalculatorToolset


class CalcData(vf.TaskData):
    answer: str


class CalcTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class CalcTask(vf.Task[CalcData, vf.State, CalcTaskConfig]):
    @classmethod
    def toolsets(cls, config: CalcTaskConfig) -> list[vf.Toolset]:
        return [CalculatorToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)

    @vf.reward(weight=0.2)
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(any(m.name == "calc_calculator" for m in trace.tool_messages))


class CalcTasksetConfig(vf.TasksetConfig):
    task: CalcTaskConfig = CalcTaskConfig()
    num_tasks: int = 8


class CalcTaskset(vf.Taskset[CalcTask, CalcTasksetConfig]):
    def load(self):
        for i in range(self.config.num_tasks):
            yield CalcTask(CalcData(id=f"calc-{i}", prompt="What is 37 * 41?", answer="1517"), self.config.task)


__all__ = ["CalcTaskset"]
