"""The calculator as a verifiers MCP toolset (the package launches this module as a server)."""

from __future__ import annotations

import verifiers.v1 as vf


# The tool as the package lists it to the model (its MCP server's schema, prefixed): what a tiny
# model is taught to call (tests/helpers/sdk_agents.py: demonstrations).
LISTED = {
    "type": "function",
    "function": {
        "name": "calc_calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"title": "Expression", "type": "string"}},
            "required": ["expression"],
            "title": "calculatorArguments",
        },
    },
}


class CalculatorToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "calc"

    @vf.tool
    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression."""
        return str(eval(expression)) if set(expression) <= set("0123456789+-*/(). ") else "error"  # noqa: S307


if __name__ == "__main__":
    CalculatorToolset.run()
