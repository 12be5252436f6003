#!/bin/bash
# Reward 1 when feature/notes holds one new commit "Update notes" with the change, main is untouched
# and nothing is left uncommitted.
# The repository's .git/config, hooks and attributes drivers are the agent's data: git run inside it could
# run the agent's commands (core.fsmonitor, filters) with the verifier's rights. So its objects and refs are
# read through a local bare clone (which copies them and runs nothing the repository configures), with no
# user or system config, and the working tree is compared from that clone.
export GIT_CONFIG_GLOBAL=/dev/null GIT_CONFIG_NOSYSTEM=1
fail() { echo "$1"; echo 0 > /logs/verifier/reward.txt; exit 0; }
[ -d /app/repo/.git ] || fail "/app/repo is not a git repository"
git clone -q --bare /app/repo /tmp/check.git 2>&1 || fail "/app/repo cannot be read as a repository"
cp /app/repo/.git/index /tmp/check.git/index 2>/dev/null
g() { git --git-dir=/tmp/check.git --work-tree=/app/repo -c core.bare=false "$@"; }
ok=1
[ "$(g log -1 --format=%s feature/notes 2>/dev/null)" = "Update notes" ] || { echo "no Update notes commit on feature/notes"; ok=0; }
[ "$(g show feature/notes:notes.txt 2>/dev/null)" = "$(printf 'first line\nsecond line')" ] || { echo "notes.txt not committed"; ok=0; }
[ "$(g log -1 --format=%s main)" = "Add notes" ] || { echo "main moved"; ok=0; }
[ "$(g rev-parse feature/notes~1 2>/dev/null)" = "$(g rev-parse main)" ] || { echo "feature/notes does not start at main"; ok=0; }
[ -z "$(g status --porcelain)" ] || { echo "working tree not clean"; g status --porcelain; ok=0; }
echo $ok > /logs/verifier/reward.txt
