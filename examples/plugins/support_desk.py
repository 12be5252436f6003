"""A multi-turn task with simulator-backed tools and a simulated user: a support desk where a customer
asks for a refund. The tools are methods of an in-process order-system simulator whose state lives in
the episode's state store (so it survives a change of agent worker); the customer is simulated by the
environment's `step`. One file, public API only.

Run it: `rollway up examples/plugins/support_desk.yaml` (the `gold` policy plays the reference
solution), or `rollway tasks verify examples/plugins/support_desk.yaml`."""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field

from rollway.envs.base import Environment, Episode, Grade, Step, Task, TaskSet
from rollway.envs.config import TasksConfig
from rollway.sandboxes.base import Sandbox, SandboxProvider, SandboxSpec
from rollway.tools.base import Tool, ToolContext, ToolResult
from rollway.tools.config import ToolsConfig


class OrderSystem:
    """The simulator: orders and refunds, rebuilt from (and saved to) the episode's state store."""

    def __init__(self, state: dict[str, Any], task: Task) -> None:
        self.state = state
        state.setdefault("orders", {o["id"]: dict(o) for o in task.metadata["orders"]})
        state.setdefault("refunded", [])

    def lookup(self, order_id: str) -> dict[str, Any] | None:
        return self.state["orders"].get(order_id)

    def refund(self, order_id: str) -> str:
        order = self.lookup(order_id)
        if order is None:
            return f"no order {order_id}"
        if order["status"] != "delivered":
            return f"order {order_id} is {order['status']}; only delivered orders can be refunded"
        order["status"] = "refunded"
        self.state["refunded"] = [*self.state["refunded"], order_id]
        return f"order {order_id} refunded ({order['amount']} EUR)"


ORDER_ARGS = {"type": "object", "properties": {"order_id": {"type": "string", "description": "e.g. A-17"}},
              "required": ["order_id"], "additionalProperties": False}


class LookupOrderTool(Tool):
    name = "desk_lookup_order"
    description = "Look up an order of the shop by its id: item, amount, status."
    parameters = ORDER_ARGS

    def __init__(self, cfg: ToolsConfig) -> None:
        self.cfg = cfg

    async def call(self, arguments: dict[str, Any], sandbox: Sandbox, context: ToolContext) -> ToolResult:
        order = OrderSystem(context.state, context.task).lookup(arguments["order_id"])
        if order is None:
            return ToolResult(f"No order {arguments['order_id']!r}.", is_error=True)
        return ToolResult(json.dumps(order))


class RefundOrderTool(Tool):
    name = "desk_refund_order"
    description = "Refund a delivered order by its id."
    parameters = ORDER_ARGS

    def __init__(self, cfg: ToolsConfig) -> None:
        self.cfg = cfg

    async def call(self, arguments: dict[str, Any], sandbox: Sandbox, context: ToolContext) -> ToolResult:
        return ToolResult(OrderSystem(context.state, context.task).refund(arguments["order_id"]))


HERE = "examples/plugins/support_desk.py"
TOOLS = (f"python:{HERE}:LookupOrderTool", f"python:{HERE}:RefundOrderTool")


class SupportDeskConfig(TasksConfig):
    """`tasks:` for the support desk: the TasksConfig fields plus its own."""

    customers: int = Field(2, ge=1, le=3)
    """Customers (tasks): each wants one of their orders refunded."""


CUSTOMERS = [
    {"name": "Ada", "want": "A-17", "orders": [{"id": "A-17", "item": "kettle", "amount": 30, "status": "delivered"},
                                              {"id": "A-18", "item": "mug", "amount": 8, "status": "delivered"}]},
    {"name": "Bo", "want": "B-2", "orders": [{"id": "B-1", "item": "lamp", "amount": 45, "status": "shipped"},
                                             {"id": "B-2", "item": "desk", "amount": 120, "status": "delivered"}]},
    {"name": "Cy", "want": "C-9", "orders": [{"id": "C-9", "item": "chair", "amount": 80, "status": "delivered"}]},
]


def tool_call(name: str, **arguments: object) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


class DeskEnvironment(Environment):
    async def step(self, output: str, episode: Episode) -> Step:
        """The tool calls, then the simulated customer: gives the order id once asked, says goodbye once refunded."""
        step, want, state = await self.run_tools(output, episode), self.task.metadata["want"], episode.state
        if step.done or episode.stop_reason:
            return step
        said = [m["content"] for m in episode.messages if m["role"] == "assistant"] + [output]
        if want in state.get("refunded", []):
            step.user_message, step.done = "Thank you, that's all!", "user_done"
        elif any("order" in text.lower() for text in said) and not state.get("told"):
            state["told"] = True
            step.user_message = f"It's order {want}."
        elif output and not step.observations:
            step.user_message = "Can you help me?"
        return step


class SupportDeskTaskSet(TaskSet):
    config_class = SupportDeskConfig
    system_prompt = ("You are a support agent of a shop. Ask the customer what you need, use the desk tools, "
                     "and refund only what they ask for.")
    default_tools = TOOLS
    require_tool_call = False  # talking to the customer is a turn without a tool call
    environment_class = DeskEnvironment

    def __init__(self, cfg: SupportDeskConfig) -> None:
        self._tasks = [Task(f"desk-{c['name'].lower()}", f"Hi, I'm {c['name']}. I want a refund, please.",
                            metadata=c) for c in CUSTOMERS[: cfg.customers]]

    def tasks(self) -> list[Task]:
        return list(self._tasks)

    def sandbox_spec(self, task: Task) -> SandboxSpec:
        return SandboxSpec()  # the tools talk to the simulator, not to the sandbox

    def reference_solution(self, task: Task) -> list[str]:
        want = task.metadata["want"]
        return ["Happy to help! What is your order number?",
                tool_call("desk_lookup_order", order_id=want),
                tool_call("desk_refund_order", order_id=want)]

    async def grade(self, task: Task, sandbox: Sandbox, provider: SandboxProvider, episode: Episode) -> Grade:
        refunded = episode.state.get("refunded", [])
        ok = refunded == [task.metadata["want"]]
        return Grade(float(ok), ok, details={"refunded": refunded, "turns": len(episode.turns),
                                             "user_messages": sum(m["role"] == "user" for m in episode.messages)})
