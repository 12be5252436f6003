"""Subprocess jobs in tests, limited by progress instead of a fixed time: a job is killed only when it has
stopped advancing (no new output, no change in the folders it writes, no CPU used by its processes) for a
generous stall window, or when it outlives a ceiling far above its normal time. A job that is merely slow,
on a machine busy with other work, still advances and is waited for; a hung one fails with a message that
names what it was doing (its last output lines and its processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path

STALL_S = float(os.environ.get("ROLLWAY_TEST_STALL_S", "300"))
"""Seconds without progress after which a job counts as hung. Under load 10-18 on two cores every job still
got CPU within seconds, so 300 is far beyond a slow machine's pauses; raise it with ROLLWAY_TEST_STALL_S."""
CEILING_S = float(os.environ.get("ROLLWAY_TEST_CEILING_S", "2400"))
"""Seconds after which a job still advancing is stopped anyway: catches a hang that keeps spinning (a loop
that prints or burns CPU forever). Far above the suite's longest job (a few minutes on an idle machine)."""
CPU_S = 1.0
"""CPU seconds the job's processes must use since the last sign of progress for the CPU to count as one: a
job blocked on a lock or a socket uses none."""
OUTPUT_DIR_FLAGS = ("--run-dir", "--out", "--output")
"""Arguments whose value is a folder the job writes: watched for changes without being named in `watch`."""


class JobHung(AssertionError):
    """A test's subprocess job stopped advancing (or outlived the ceiling) and was killed."""


def run_with_progress(argv: Sequence[str], *, stall_s: float | None = None, ceiling_s: float | None = None,
            watch: Sequence[str | Path] = (), cpu_s: float = CPU_S, input: str | None = None,  # noqa: A002
            text: bool = True, cwd: str | Path | None = None, env: dict[str, str] | None = None,
            name: str | None = None) -> subprocess.CompletedProcess:
    """`subprocess.run(argv, capture_output=True, text=text, cwd=cwd, env=env, input=input)` without a fixed
    timeout: the job runs while it advances. Progress is any new byte on stdout or stderr, any change (file
    added, grown, touched) under the `watch` paths and the folders given to --run-dir/--out, or `cpu_s` CPU
    seconds used by the job's process tree. No progress for `stall_s` (default STALL_S), or a run past
    `ceiling_s` (default CEILING_S): the job's process group is killed and JobHung raised with its last
    output lines and what its processes were doing."""
    stall_s = STALL_S if stall_s is None else stall_s
    ceiling_s = CEILING_S if ceiling_s is None else ceiling_s
    name = name or " ".join(str(a) for a in argv[:6])
    watched = [Path(p) for p in watch] + _output_dirs(argv, cwd)
    proc = subprocess.Popen([str(a) for a in argv], stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd, env=env, start_new_session=True)
    streams = {"stdout": _Stream(proc.stdout), "stderr": _Stream(proc.stderr)}
    if input is not None:
        threading.Thread(target=_feed, args=(proc.stdin, input.encode() if text else input), daemon=True).start()
    output = (lambda: sum(s.size for s in streams.values()),
              lambda: f"last stderr lines:\n{streams['stderr'].tail()}\nlast stdout lines:\n{streams['stdout'].tail()}")
    wait_with_progress(proc, name=name, watch=watched, stall_s=stall_s, ceiling_s=ceiling_s, cpu_s=cpu_s, output=output)
    for stream in streams.values():
        stream.thread.join(60)  # a child that outlives the job and holds the pipe: keep what came
    out, err = (s.value(text) for s in streams.values())
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def wait_with_progress(proc: subprocess.Popen, *, name: str | None = None, watch: Sequence[str | Path] = (),
                       stall_s: float | None = None, ceiling_s: float | None = None, cpu_s: float = CPU_S,
                       output: tuple | None = None) -> int:
    """`proc.wait()` for a job the test started itself, limited by its progress like `run_with_progress`: new
    bytes in the `watch` files and folders (its log, its run folder) or CPU used by its process tree. Returns
    the exit code; no progress for `stall_s`, or a run past `ceiling_s`: kills the job (its process group when
    it leads one) and raises JobHung with the tail of each watched file and its processes. `output`: (size,
    tail) callables of output captured in this process."""
    stall_s = STALL_S if stall_s is None else stall_s
    ceiling_s = CEILING_S if ceiling_s is None else ceiling_s
    name = name or " ".join(str(a) for a in (proc.args if isinstance(proc.args, list) else [proc.args])[:6])
    watched = [Path(p) for p in watch]
    size, tails = output or (lambda: 0, lambda: "\n".join(f"last lines of {p}:\n{_file_tail(p)}" for p in watched
                                                             if p.is_file()))
    started = last_progress = walked = time.monotonic()
    seen = (size(), _tree_signature(watched), _tree_cpu(proc.pid))
    cpu_mark = seen[2]
    while True:
        try:  # returns the moment the job ends (a job of 0.1 s is not held to a polling period)
            proc.wait(0.5)
            break
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        out, files, cpu = size(), seen[1], seen[2]
        # A walk of a run folder or of /proc (every process on the machine: about 10 ms) costs CPU, paid by the
        # tests beside this one: every 5 s at most, far inside the stall window.
        if now - walked >= min(5.0, stall_s / 4):
            files, cpu, walked = _tree_signature(watched), _tree_cpu(proc.pid), now
        cpu_mark = min(cpu_mark, cpu)  # a process that exited took its CPU seconds along
        if out != seen[0] or files != seen[1] or cpu - cpu_mark >= cpu_s:
            last_progress, cpu_mark = now, cpu
        seen = (out, files, cpu)
        if now - last_progress > stall_s or now - started > ceiling_s:
            tree = _describe_tree(proc.pid)
            _kill_group(proc)
            why = (f"made no progress for {now - last_progress:.0f} s (no output, no change in "
                   f"{[str(p) for p in watched] or 'any watched folder'}, under {cpu_s} CPU s)"
                   if now - last_progress > stall_s else f"was still running after the ceiling of {ceiling_s:.0f} s")
            raise JobHung(f"job `{name}` {why}; killed after {now - started:.0f} s as hung.\n"
                          f"its processes when killed:\n{tree}\n{tails()}")
    return proc.returncode


def _file_tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) or "(empty)"
    except OSError:
        return "(unreadable)"


class _Stream:
    """Reads a pipe in a thread, keeping every byte (the caller gets all of it, like subprocess.run)."""

    def __init__(self, pipe) -> None:
        self.chunks: list[bytes] = []
        self.size = 0
        self.thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self.thread.start()

    def _read(self, pipe) -> None:
        with pipe:
            while chunk := os.read(pipe.fileno(), 65536):
                self.chunks.append(chunk)
                self.size += len(chunk)

    def value(self, text: bool) -> str | bytes:
        data = b"".join(self.chunks)
        return data.decode(errors="replace") if text else data

    def tail(self, lines: int = 25) -> str:
        return "\n".join(self.value(True).splitlines()[-lines:]) or "(none)"


def _feed(pipe, data: bytes) -> None:
    try:
        with pipe:
            pipe.write(data)
    except BrokenPipeError:
        pass


def _output_dirs(argv: Sequence[str], cwd: str | Path | None) -> list[Path]:
    found = []
    for flag, value in zip(argv, argv[1:], strict=False):
        if str(flag) in OUTPUT_DIR_FLAGS:
            path = Path(value)
            found.append(path if path.is_absolute() or cwd is None else Path(cwd) / path)
    return found


def _tree_signature(paths: list[Path]) -> tuple:
    """What changes when a job writes under `paths`: each file's name, size and modification time."""
    entries = []
    for root in paths:
        if root.is_file():
            entries.append((str(root), *_stat(root)))
            continue
        for folder, _dirs, files in os.walk(root):
            entries += [(f"{folder}/{f}", *_stat(Path(folder) / f)) for f in files]
    return tuple(sorted(entries))


def _stat(path: Path) -> tuple[int, int]:
    try:
        st = path.stat()
        return st.st_size, st.st_mtime_ns
    except OSError:
        return -1, -1


def _proc_table() -> dict[int, tuple[int, float, str]]:
    """pid -> (parent pid, CPU seconds it used itself and in its reaped children, state letter)."""
    tick = os.sysconf("SC_CLK_TCK")
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            table[int(entry)] = (int(fields[1]), sum(int(f) for f in fields[11:15]) / tick, fields[0])
    return table


def _tree(table: dict[int, tuple[int, float, str]], root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, stack = [], [root]
    while stack:
        pid = stack.pop()
        if pid in table:
            found.append(pid)
            stack += children.get(pid, [])
    return found


def _tree_cpu(root: int) -> float:
    """CPU seconds used by the job's live processes and the children they reaped (a process that exited
    unreaped-by-us drops out: a drop is never progress, only growth is)."""
    table = _proc_table()
    return sum(table[pid][1] for pid in _tree(table, root))


def _describe_tree(root: int) -> str:
    table = _proc_table()
    lines = []
    for pid in _tree(table, root):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            wchan = Path(f"/proc/{pid}/wchan").read_text().strip() or "-"
        except OSError:
            cmd, wchan = "?", "?"
        lines.append(f"  pid {pid} state {table[pid][2]} waiting in {wchan} cpu {table[pid][1]:.1f}s: {cmd[:400]}")
    return "\n".join(lines) or "  (none left)"


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL: to the job's process group when it leads one, else to the job alone."""
    try:
        leads = os.getpgid(proc.pid) == proc.pid
    except ProcessLookupError:
        return
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig) if leads else proc.send_signal(sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
