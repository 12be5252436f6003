"""A tiny agent program that rewrites its own history, to train through rollway's gateway.

Run it with OPENAI_BASE_URL and OPENAI_API_KEY set to an episode's gateway credential, inside the
episode's sandbox (it runs the model's shell commands): `python examples/agent_program.py "TASK"`."""

import json
import os
import subprocess
import sys

from openai import OpenAI

SHELL = {"type": "function", "function": {"name": "shell", "description": "Run a shell command.", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}


def run_shell(arguments: str) -> str:
    done = subprocess.run(json.loads(arguments)["command"], shell=True, capture_output=True, text=True, timeout=60)
    return (done.stdout + done.stderr)[-2000:]


def main(task: str, max_steps: int = 8, keep: int = 4) -> None:
    client = OpenAI(max_retries=0)  # reads OPENAI_BASE_URL and OPENAI_API_KEY
    system = {"role": "system", "content": "You solve tasks with the shell tool, then reply with a summary."}
    history: list[dict] = [{"role": "user", "content": task}]
    for _ in range(max_steps):
        reply = client.chat.completions.create(model=os.environ.get("OPENAI_MODEL", "policy"),
                                               messages=[system, *history], tools=[SHELL]).choices[0].message
        history.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            print(reply.content)
            return
        for call in reply.tool_calls:
            history.append({"role": "tool", "tool_call_id": call.id, "content": run_shell(call.function.arguments)})
        if len(history) > keep:  # compaction: earlier turns become one summary line (a new segment)
            history = [{"role": "user", "content": f"{task}\nSummary: {len(history) - 2} earlier messages "
                                                   "dropped; continue from the last command."}, *history[-2:]]


if __name__ == "__main__":
    main(" ".join(sys.argv[1:]) or "Say hello.")
