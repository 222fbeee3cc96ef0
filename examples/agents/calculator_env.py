"""Multi-turn tool use as an Env: the model calls a calculator; the framework renders each result as a
tool turn (token-exact delta) and samples again, until the model answers or 4 turns have passed."""

import ast
import operator
import re

from instar.agents import Env, Result, StepEnvRunner

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression with + - * and integers.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> str:
    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        raise ValueError(node)
    try:
        return str(ev(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, RecursionError):
        return "error: use integers with + - *"


class CalculatorEnv(Env):
    tools = [CALCULATOR]  # rendered into the system turn by the chat template

    async def step(self, state: dict) -> Result:
        message = state["messages"][-1]  # the sampled turn, with tool calls parsed out of its text
        calls = message.get("tool_calls") or []
        if calls and state["turn"] < 3:
            expression = str(calls[0]["function"]["arguments"].get("expression", ""))
            # Not terminated: the observation becomes a tool turn and the model samples again.
            return Result(reward=0.0, observation=calculate(expression), terminated=False, info={"tool": expression})
        numbers = re.findall(r"-?\d+", message["content"])
        correct = bool(numbers) and numbers[-1] == str(state["label"])
        return Result(reward=float(correct), score=float(correct), info={"tool": None})


AgentRunner = StepEnvRunner(CalculatorEnv)
