"""Calculator tasks: a two-step tool-use job (compute with a tool, report with another) sized for
small models, used by the learning run (examples/learn.yaml)."""

from __future__ import annotations

import ast
import json
import operator
import random
from typing import Any

from rollway.envs.base import Environment, Episode, Grade, Task, TaskSet
from rollway.envs.config import CalcTasksConfig
from rollway.sandboxes.base import Sandbox, SandboxError, SandboxProvider, SandboxSpec
from rollway.tools.base import Tool, ToolContext, ToolResult
from rollway.tools.config import ToolsConfig
from rollway.tools.registry import register_tool

ANSWER_FILE = ".rollway/answer.txt"
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}

SYSTEM_PROMPT = "You answer arithmetic questions. Call the calculator tool, then report its result with the answer tool."


def _call(name: str, **arguments: str) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def worked_example(question: str, expression: str, result: int) -> list[dict[str, str]]:
    """One solved episode, shown to the model as earlier turns of the conversation."""
    return [{"role": "user", "content": question},
            {"role": "assistant", "content": _call("calculator", expression=expression)},
            {"role": "tool", "content": str(result)},
            {"role": "assistant", "content": _call("answer", value=str(result))},
            {"role": "tool", "content": "Answer recorded."}]


FEW_SHOT = [*worked_example("What is 12 * 3?", "12 * 3", 36), *worked_example("What is 40 - 17?", "40 - 17", 23)]


def evaluate(expression: str) -> int:
    """Integer +, -, * only (no names, calls or powers): safe to run in the worker."""
    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        raise ValueError("only integers with + - * and parentheses are allowed")
    if len(expression) > 200:
        raise ValueError("expression too long (200 characters at most)")
    return walk(ast.parse(expression.strip(), mode="eval"))


class CalculatorTool(Tool):
    name = "calculator"
    description = "Evaluate an integer arithmetic expression with + - * and parentheses."
    parameters = {"type": "object", "properties": {"expression": {"type": "string", "description": "e.g. 12 * 3"}},
                  "required": ["expression"], "additionalProperties": False}

    def __init__(self, cfg: ToolsConfig | None = None) -> None:
        self.cfg = cfg

    async def call(self, arguments: dict[str, Any], sandbox: Sandbox, context: ToolContext) -> ToolResult:
        try:
            return ToolResult(content=str(evaluate(str(arguments["expression"]))))
        except (ValueError, SyntaxError) as err:
            return ToolResult(content=f"calculator error: {err}", is_error=True)


class AnswerTool(Tool):
    name = "answer"
    description = "Report the final answer. The episode ends after this call."
    parameters = {"type": "object", "properties": {"value": {"type": "string", "description": "the final answer"}},
                  "required": ["value"], "additionalProperties": False}

    def __init__(self, cfg: ToolsConfig | None = None) -> None:
        self.cfg = cfg

    async def call(self, arguments: dict[str, Any], sandbox: Sandbox, context: ToolContext) -> ToolResult:
        # Kept in the sandbox so the reward actor (another process) can grade it.
        await sandbox.write_file(ANSWER_FILE, str(arguments["value"]).strip())
        return ToolResult(content="Answer recorded.", ends_episode=True)


register_tool("calculator", CalculatorTool)
register_tool("answer", AnswerTool)


class CalcEnvironment(Environment):
    async def start(self, system_prompt: str | None = None) -> list[dict[str, Any]]:
        return [{"role": "system", "content": system_prompt or self.taskset.system_prompt}, *FEW_SHOT,
                {"role": "user", "content": self.task.prompt}]


class CalcTaskSet(TaskSet):
    """Task k: "What is a OP b?" with seeded operands; reward 1 when the reported answer is right."""

    system_prompt = SYSTEM_PROMPT
    default_tools = ("calculator", "answer")
    describe_tools = False  # a 135M model follows two worked examples better than JSON tool specs
    environment_class = CalcEnvironment

    def __init__(self, cfg: CalcTasksConfig, seed: int = 20261122):
        rng = random.Random(seed)
        tasks = []
        for k in range(cfg.count):
            a, b, op = rng.randint(11, 99), rng.randint(11, 99), rng.choice("+-*")
            tasks.append(Task(task_id=f"calc-{k:04d}", prompt=f"What is {a} {op} {b}?",
                              metadata={"expression": f"{a} {op} {b}", "expected": evaluate(f"{a} {op} {b}")}))
        self._tasks = tasks

    def tasks(self) -> list[Task]:
        return list(self._tasks)


    def sandbox_spec(self, task: Task) -> SandboxSpec:
        return SandboxSpec()

    async def grade(self, task: Task, sandbox: Sandbox, provider: SandboxProvider, episode: Episode) -> Grade:
        try:
            answer = (await sandbox.read_file(ANSWER_FILE)).strip()
        except (SandboxError, OSError):
            return Grade(0.0, False, details={"answer": None, "expected": task.metadata["expected"]})
        ok = answer.replace(",", "") == str(task.metadata["expected"])
        return Grade(1.0 if ok else 0.0, ok, details={"answer": answer[:50], "expected": task.metadata["expected"]})
