"""A tiny agent program on the Anthropic SDK, to train through rollway's gateway (`POST /v1/messages`).

Run it with ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY set to an episode's gateway credential (a harness
episode sets both), inside the episode's sandbox (it runs the model's shell commands):
`python examples/anthropic_agent_program.py "TASK"`."""

import os
import subprocess
import sys

from anthropic import Anthropic

SHELL = {"name": "shell", "description": "Run a shell command.", "input_schema": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}


def run_shell(command: str) -> str:
    done = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=60)
    return (done.stdout + done.stderr)[-2000:]


def main(task: str, max_steps: int = 8) -> None:
    client = Anthropic(max_retries=0)  # reads ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY
    messages: list[dict] = [{"role": "user", "content": task}]
    for _ in range(max_steps):
        reply = client.messages.create(model=os.environ.get("OPENAI_MODEL", "policy"), max_tokens=512, tools=[SHELL],
                                       system="You solve tasks with the shell tool, then reply with a summary.",
                                       messages=messages)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        uses = [b for b in reply.content if b.type == "tool_use"]
        if not uses:
            print("".join(b.text for b in reply.content if b.type == "text"))
            return
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": b.id, "content": run_shell(b.input["command"])} for b in uses]})


if __name__ == "__main__":
    main(" ".join(sys.argv[1:]) or "Say hello.")
