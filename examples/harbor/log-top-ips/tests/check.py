"""Recount the log independently and compare with top404.txt. The log is made again here from the same
generator as the image's (tests/make_log.py is a copy of environment/make_log.py): /app/access.log is in
the agent's hands, and a recount of an edited log would grade whatever the agent chose."""
import collections
import contextlib
import io
import pathlib
import runpy
import sys

log = io.StringIO()
with contextlib.redirect_stdout(log):
    runpy.run_path(str(pathlib.Path(__file__).with_name("make_log.py")))
counts = collections.Counter()
for line in log.getvalue().splitlines():
    fields = line.split()
    if len(fields) > 8 and fields[8] == "404":
        counts[fields[0]] += 1
want = [f"{n} {ip}" for ip, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:3]]
path = pathlib.Path("/app/top404.txt")
got = path.read_text().split("\n") if path.exists() else []
got = [line.strip() for line in got if line.strip()]
if got != want:
    print(f"top404.txt: {got}, want {want}")
    sys.exit(1)
