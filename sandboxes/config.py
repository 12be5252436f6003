"""Sandbox configuration (owned by the sandboxes package): the limits every sandbox honours
(`SandboxConfig`) and one config class per provider with its own fields, chosen by `sandbox.type`."""

from __future__ import annotations

import ipaddress
from typing import ClassVar, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from rollway.base.config import StrictModel
from rollway.base.plugins import PluginRef
from rollway.base.registry import SectionConfig


class SandboxConfig(SectionConfig):
    """The `sandbox:` section: which kind of sandbox every episode gets, and the limits of one command
    (fields every provider has; a provider's own are on its config class below)."""

    registry: ClassVar[str | None] = "rollway.sandboxes.factory:SANDBOXES"

    type: Literal["local", "docker", "sim"] | PluginRef = "local"
    """`local`: bubblewrap jail over a workspace folder. `docker`: one container per episode. `sim`:
    simulated start-up/command/test times for benchmarks (`rollway bench pipeline`). `python:MODULE:CLASS`
    (or `python:FILE.py:CLASS`): your own SandboxProvider subclass (docs/extending.md, "Writing a sandbox")."""
    root: str | None = None
    """Folder under which episode workspaces are created; default a temp folder shared by workers."""
    exec_timeout_s: float = Field(30.0, gt=0)
    """Default wall-time limit for one command in the sandbox. Four times it bounds rollway's own work over
    a workspace the agent filled (a SWE task's diff, a Harbor workspace's carry into its verifier), which
    the scheduler's wait for a grading counts."""

    @property
    def keeper_timeout_s(self) -> float:
        """Wall-time limit of rollway's own commands in a sandbox (the workspace's diff, a copy out of it):
        longer than a command's, as the agent may have filled the workspace up to `workspace_mb`."""
        return self.exec_timeout_s * 4
    memory_mb: int = Field(1024, ge=16)
    """Memory of one sandbox as a whole (all its processes, and its tmpfs pages): the container's
    memory limit for `docker`, a memory cgroup for `local` (where cgroups are writable; where they are
    not, each process of the jail is held to this much address space instead: `address_space_mb`)."""
    max_processes: int = Field(256, ge=1)
    """Processes/threads of one sandbox (stops fork bombs): pids limit of the container or cgroup,
    and RLIMIT_NPROC inside a local jail."""
    cpus: float = Field(1.0, gt=0, le=256)
    """CPU cores one sandbox may use at most (a CFS quota: docker nano_cpus, cgroup cpu quota)."""
    shm_mb: int = Field(64, ge=1)
    """Size of /dev/shm inside the sandbox (a tmpfs, charged to the sandbox's memory)."""
    max_output_bytes: int = Field(64_000, ge=256)
    """Output captured per command; the rest is cut with a visible notice."""
    max_file_mb: int = Field(256, ge=1)
    """Largest file a command may write."""
    max_open_files: int = Field(4096, ge=64)
    """Open descriptors of each process in the sandbox (RLIMIT_NOFILE, soft and hard: `ulimit -n` in a
    local jail, the container's nofile ulimit). The gateway bounds an episode's connections itself
    (agent.harness.limits); this keeps one process from holding more of anything."""
    workspace_mb: int = Field(768, ge=16)
    """Size cap of the workspace: a docker sandbox's workspace volume (a tmpfs owned by the sandbox
    user); for `local`, a size-capped filesystem mounted on the workspace folder when rollway runs as
    root (see docs/agents.md, "Sandboxes"). Its pages are memory: kept below `memory_mb`, a full workspace
    is a "No space left" error rather than an out-of-memory kill."""
    tmp_mb: int = Field(512, ge=1)
    """Size of the private /tmp inside the sandbox (a tmpfs, so it counts against memory). In a `local`
    jail /tmp is fresh for every command; in a `docker` container it lasts the episode."""
    home: Literal["persistent", "tmp"] = "persistent"
    """HOME of every command. `persistent`: /home/sandbox, a folder of the episode's sandbox kept
    across its commands (dotfiles, caches), outside the workspace so it is not part of the diff.
    `tmp`: HOME=/tmp (in a `local` jail a fresh /tmp per command: nothing written there lasts)."""
    output_kill_mb: int = Field(64, ge=1)
    """A command that prints more than this is killed: beyond `max_output_bytes` output is only
    counted, and this bounds how long a command like `yes` can keep a worker busy."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables of every command, e.g. {PIP_NO_INDEX: "1"}; they override rollway's
    own (PATH, HOME, LANG, ...)."""


class LocalSandboxConfig(SandboxConfig):
    """`sandbox.type: local`: a bubblewrap jail over a workspace folder."""

    implementation = "local"

    python: str | None = None
    """Python interpreter made visible inside the jail (default: the one running rollway). With the default,
    pytest in the jail loads no plugin by entry point (PYTEST_DISABLE_PLUGIN_AUTOLOAD): the plugins installed
    beside rollway (its own test tools) are not the project's. A project whose tests need plugins names an
    interpreter that has them here; its plugins then load as usual."""
    host_uid: int | None = None
    """Host user bwrap runs as when rollway runs as root (default 65534, nobody). The kernel never
    enforces RLIMIT_NPROC for host root, even inside a user namespace, so a jail mapped to root
    would let a fork bomb through."""
    address_space_mb: int | None = Field(None, ge=16)
    """Address space (RLIMIT_AS, `ulimit -v`) of each process in the jail. None: no such limit where the
    sandbox's memory cgroup holds its real memory (root with writable cgroups), and the sandbox's
    `memory_mb` where no cgroup can, or where it cannot hold swap (a host with swap but no swap
    accounting): then the per-process limit is the only bound; `rollway sandbox check` reports which
    (`cgroups`, `address_space`). node/V8, the JVM and Go reserve far more address space than they use
    (Qwen Code's node: 15.9 GB for 0.2 GB resident), so they fail under a limit near `memory_mb`. A
    number: this limit for every process, cgroup or not."""
    bwrap: str = "bwrap"
    """bubblewrap executable (name on PATH or absolute path)."""
    ro_binds: list[str] = Field(default_factory=list)
    """Extra host folders made visible read-only inside the jail at the same path (e.g. data)."""
    workdir: str = "/workspace"
    """Where the workspace (the task's files, what `diff` and grading see) appears inside the sandbox,
    and the working folder of every command. (`docker` keeps /workspace.)"""

    @field_validator("workdir")
    @classmethod
    def _workdir_is_own_folder(cls, value: str) -> str:
        path = value.rstrip("/")
        parts = path.split("/")[1:]
        # /home/<user> is a user's folder (a task may expect its repository there); /home itself and the
        # jail's own HOME (/home/sandbox) are not.
        own_home = parts[:1] == ["home"] and len(parts) >= 2 and parts[1] != "sandbox" and ".." not in parts
        if not value.startswith("/") or not parts or (not own_home and parts[0] in (
                "usr", "bin", "lib", "lib64", "sbin", "etc", "proc", "dev", "tmp", "home", "sys", "run")):
            raise ValueError(f"sandbox.workdir={value!r} must be an absolute folder outside the system folders "
                             "(e.g. /workspace, /repo or /home/agent; not /home/sandbox, the jail's HOME)")
        return path


class EngineConfig(StrictModel):
    """One Docker engine of the fleet (`sandbox.engines`): how to reach it and how many sandboxes it holds.
    Certificates and keys are named by path only: their contents are never read into the configuration,
    a handle, a log line or a run folder."""

    id: str = Field("local", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,39}$")
    """The engine's name in sandbox handles and status (a handle names its engine by this id, never by
    URL or credential): every worker of a run must give the same engine the same id."""
    endpoint: str | None = None
    """`unix:///PATH`, `tcp://HOST:PORT` (with the tls_* files; plain TCP only on a loopback address) or
    `ssh://USER@HOST[:PORT][/SOCKET]` (the engine's unix socket on that host, /var/run/docker.sock unless a
    path is given, forwarded to a private socket here by the system's `ssh` client; ssh_key and ssh_known_hosts
    below). None: the local engine (DOCKER_HOST, else /var/run/docker.sock)."""
    tls_ca: str | None = None
    """Path of the CA certificate that signed the engine's server certificate (verified on every
    connection). None with tls_cert: the system's CAs."""
    tls_cert: str | None = None
    """Path of this client's certificate (PEM), presented to an engine started with --tlsverify."""
    tls_key: str | None = None
    """Path of this client's private key (PEM). A secret: keep the file private (mode 0600); only its
    path is ever written anywhere."""
    ssh_key: str | None = None
    """`ssh://` only: path of the private key ssh logs in with (no other key is tried). A secret like
    tls_key: only its path is ever written anywhere. None: the ssh client's own keys (agent, ~/.ssh)."""
    ssh_known_hosts: str | None = None
    """`ssh://` only: path of a known_hosts file holding the engine host's key; a host whose key is not
    there, or differs, is refused (never accepted on first use). None: the ssh client's own known_hosts."""
    capacity: int | None = Field(None, ge=1)
    """Sandboxes this engine may hold at once (counted from the engine's own list of rollway-labelled
    containers, warm-pool ones included). None: no limit (placement still balances by count)."""
    timeout_s: float = Field(60.0, gt=0)
    """Time limit of one API request to this engine (a command's output stream has the command's own
    limit); a host that vanished fails requests after this long, and the engine is marked down."""

    @model_validator(mode="after")
    def _tls_off_loopback(self) -> EngineConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(f"engine {self.id!r}: tls_cert and tls_key go together (a client certificate and its key)")
        if self.endpoint is None:
            return self
        parts = urlsplit(self.endpoint)
        if parts.scheme not in ("unix", "tcp", "https", "ssh", "npipe"):
            raise ValueError(f"engine {self.id!r}: endpoint scheme {parts.scheme!r} is not one of unix://, tcp://, "
                             "ssh://")
        if (self.tls_ca or self.tls_cert) if parts.scheme == "ssh" else (self.ssh_key or self.ssh_known_hosts):
            raise ValueError(f"engine {self.id!r}: tls_* settings go with tcp:// endpoints, ssh_* with ssh:// ones")
        if parts.scheme in ("tcp", "https") and self.tls_cert is None and not _is_loopback(parts.hostname or ""):
            raise ValueError(f"engine {self.id!r}: plain TCP to {parts.hostname} is refused (anyone on the network "
                             "could drive that engine, i.e. be root on its host): give tls_ca, tls_cert and tls_key "
                             "(scripts/fleet-up.sh shows how to make them), or use ssh://")
        return self


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class DockerSandboxConfig(SandboxConfig):
    """`sandbox.type: docker`: one container per episode."""

    implementation = "docker"

    image: str = "rollway-sandbox:bookworm"
    """Docker image when a task names none. The default is built here, offline, by
    `scripts/setup-docker.sh` (Debian bookworm: python3, pip, git, bash, patch); nothing is pulled."""
    warm_pool: int = Field(0, ge=0, le=64)
    """Started containers each provider (the init stage's) keeps ready per image, so
    an episode's sandbox skips the container start; 0 = none. Idle ones are removed when the stage
    stops (`rollway-pool-*` containers left by a killed worker can be removed by hand)."""
    ro_binds: list[str] = Field(default_factory=list)
    """Host folders bound read-only into every container at the same path (a harness program's
    `install.type: host_dir` folder is added here)."""
    gateway_root: str | None = None
    """Host folder under which each container gets its own subfolder, bound read-only at
    /rollway-gateway (relayed there by the keeper on an engine of another host): harness episodes
    (agent.harness) reach the gateway's unix socket there, the container's only way out. None: no such
    folder (set by agent.harness when unset)."""
    engines: list[EngineConfig] = Field(default_factory=lambda: [EngineConfig()], min_length=1)
    """The fleet of Docker engines sandboxes are placed on (docs/deployment.md, "Sandboxes on several
    hosts"); default: the local engine alone. Every init, agent and reward worker of a run needs the same
    list (same ids): a handle names its engine by id. `scripts/fleet-up.sh N` prints one."""
    image_registry: str | None = None
    """`HOST:PORT` of an image registry the engines pull a missing image from (as `HOST:PORT/IMAGE`,
    tagged IMAGE after the pull); an engine that cannot get an image is skipped for it. None: an engine
    only uses the images it has."""

    @field_validator("engines")
    @classmethod
    def _unique_ids(cls, engines: list[EngineConfig]) -> list[EngineConfig]:
        ids = [e.id for e in engines]
        if len(set(ids)) != len(ids):
            raise ValueError(f"sandbox.engines: engine ids must be unique, got {ids}")
        return engines


class SimSandboxConfig(SandboxConfig):
    """`sandbox.type: sim`: simulated times for `rollway bench pipeline`."""

    implementation = "sim"
