"""A fleet of Docker engines: three extra real dockerd daemons (scripts/fleet-up.sh, TLS with client
certificates on loopback ports, the base image through a real registry), started once for this module.
Jobs run as `rollway up` with every stage its own process, reaching the engines only through their TCP
endpoints (DOCKER_HOST points nowhere); their outcome is judged from the topics (the chaos ledger)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, run, wait_until

from rollway.base.process import free_port, port_open
from rollway.config.run import load_config
from rollway.envs.sdist import DEFAULT_CACHE
from rollway.runtime.metrics import REGISTRY
from rollway.sandboxes.base import EngineUnreachable, SandboxError, SandboxSpec
from rollway.sandboxes.config import DockerSandboxConfig, EngineConfig
from rollway.sandboxes.docker import LABEL
from rollway.sandboxes.fleet import FleetSandboxProvider, check_engines, engine_client
from rollway.sandboxes.reaper import names_by_engine

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.geteuid() != 0, reason="starting Docker daemons needs root")]
CAPACITY = 3


class Fleet:
    def __init__(self, folder: Path, base_port: int, reg_port: int):
        self.folder, self.base_port, self.reg_port = folder, base_port, reg_port
        # The registry's storage outlives the fleet (fleet-up.sh pushes only an image it does not hold): the
        # push took 22 s and 24 core-seconds of the main engine per run (compressing the 300 MB image).
        self.env = {**os.environ, "ROLLWAY_FLEET_DIR": str(folder), "ROLLWAY_FLEET_PORT": str(base_port),
                    "ROLLWAY_REGISTRY_PORT": str(reg_port), "ROLLWAY_FLEET_CAPACITY": str(CAPACITY),
                    "ROLLWAY_REGISTRY_DIR": str(DEFAULT_CACHE / "fleet-registry")}
        self.args: list[str] = []

    def up(self) -> None:
        out = subprocess.run(["bash", str(ROOT / "scripts" / "fleet-up.sh"), "3"], env=self.env, capture_output=True,
                             text=True, timeout=900)
        assert out.returncode == 0, out.stderr[-3000:]
        self.args = out.stdout.strip().splitlines()

    def down(self) -> None:
        subprocess.run(["bash", str(ROOT / "scripts" / "fleet-down.sh")], env=self.env, capture_output=True, timeout=300)

    def config(self, *overrides: str) -> DockerSandboxConfig:
        return load_config(None, ["sandbox.type=docker", *self.args, *overrides]).sandbox  # type: ignore[return-value]

    def kill(self, k: int) -> None:
        """SIGKILL engine fleet-k's daemon (its host gone, as far as the API can tell)."""
        os.kill(int((self.folder / f"e{k}" / "dockerd.pid").read_text()), 9)

    def live(self) -> dict[str, list[str]]:
        """engine id -> names of the live sandbox containers it lists (engines that do not answer: left out)."""
        found = {}
        for engine in self.config().engines:
            with contextlib.suppress(Exception):
                client = engine_client(engine)
                listed = client.api.containers(all=True, filters={"label": LABEL})
                found[engine.id] = [(c.get("Labels") or {})[LABEL] for c in listed if c.get("State") == "running"]
                client.close()
        return found


def _free_ports(n: int) -> int:
    """A base port with n free ports after it (base+1 .. base+n)."""
    for _ in range(50):
        base = random.randrange(24000, 30000)
        try:
            for port in range(base + 1, base + n + 1):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise AssertionError("no free ports")


@pytest.fixture(scope="module")
def fleet():
    """Three engines and their registry, in a folder that is a tmpfs: each engine unpacks the sandbox image
    (about 300 MB of small files) into its data root, which cost 20-35 core-seconds per engine on this
    machine's disk and about 7 on a tmpfs (`fleet-up.sh 3` measured in a cgroup: 86-112 against 25 core-s)."""
    base = _free_ports(4)
    folder = Path(f"/var/lib/rollway-fleet-t{uuid.uuid4().hex[:6]}")
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4g,mode=0755", "tmpfs", str(folder)], check=True)
    f = Fleet(folder, base + 1, base + 1)  # engines: base+2..
    bridge_before = _has_docker0()
    try:
        f.up()
        # the extra daemons must leave the host's engine alone: a daemon started with --bridge=none deletes
        # docker0, and every container of the main engine with a network then fails to start
        assert _has_docker0() == bridge_before, "fleet-up.sh removed the main engine's docker0 bridge"
        yield f
    finally:
        f.down()
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)
        with contextlib.suppress(OSError):
            folder.rmdir()
    assert _has_docker0() == bridge_before, "fleet-down.sh removed the main engine's docker0 bridge"


def _has_docker0() -> bool:
    return subprocess.run(["ip", "link", "show", "docker0"], capture_output=True).returncode == 0


# ---------------------------------------------------------------- configuration (no engine needed)

def test_plain_tcp_off_loopback_is_refused_naming_the_engine():
    with pytest.raises(ValueError, match="engine 'far'.*plain TCP to 10.1.2.3 is refused"):
        EngineConfig(id="far", endpoint="tcp://10.1.2.3:2375")
    EngineConfig(id="near", endpoint="tcp://127.0.0.1:2375")  # loopback: the host's own engine
    EngineConfig(id="far", endpoint="tcp://10.1.2.3:2376", tls_ca="/x/ca.pem", tls_cert="/x/c.pem", tls_key="/x/k.pem")
    with pytest.raises(ValueError, match="tls_cert and tls_key go together"):
        EngineConfig(id="far", endpoint="tcp://10.1.2.3:2376", tls_cert="/x/c.pem")
    with pytest.raises(ValueError, match="unique"):
        DockerSandboxConfig(engines=[EngineConfig(id="a"), EngineConfig(id="a")])
    with pytest.raises(ValueError, match="engine 'x': tls_. settings go with tcp://"):
        EngineConfig(id="x", endpoint="ssh://rollway@10.1.2.3", tls_ca="/x/ca.pem")
    with pytest.raises(ValueError, match="engine 'y': tls_. settings go with tcp://"):
        EngineConfig(id="y", endpoint="tcp://127.0.0.1:2375", ssh_key="/x/id_ed25519")


def test_a_local_handle_from_another_machine_is_refused_never_matched_to_a_folder_here(tmp_path):
    from rollway.sandboxes.config import LocalSandboxConfig
    from rollway.sandboxes.local import LocalSandboxProvider

    provider = LocalSandboxProvider(LocalSandboxConfig(root=str(tmp_path)))
    box = run(provider.create(SandboxSpec(files={"a.txt": "mine"}), "same-name"))
    elsewhere = {**box.handle, "machine": "another-host"}  # the same name and path, made on another machine
    with pytest.raises(SandboxError, match="another-host"):
        run(provider.attach(elsewhere))
    with pytest.raises(SandboxError):
        run(provider.attach({k: v for k, v in box.handle.items() if k != "machine"}))
    assert run(run(provider.attach(box.handle)).read_file("a.txt")) == "mine"
    run(box.destroy())


# ---------------------------------------------------------------- the fleet, one provider

def test_a_handle_naming_an_engine_this_worker_does_not_know_fails_as_unreachable(fleet):
    provider = FleetSandboxProvider(fleet.config())
    box = run(provider.create(SandboxSpec(files={"a.txt": "x"}), f"fleet-unknown-{uuid.uuid4().hex[:6]}"))
    try:
        assert box.handle["engine"] in {"fleet-1", "fleet-2", "fleet-3"}
        assert not any(k in str(box.handle) for k in ("tcp://", "pem")), box.handle  # an id, not a URL or a key
        smaller = FleetSandboxProvider(fleet.config(f"sandbox.engines=[{{id: gone, endpoint: 'tcp://127.0.0.1:{fleet.base_port}'}}]"))
        with pytest.raises(EngineUnreachable, match=f"engine '{box.handle['engine']}', which this worker's sandbox.engines"):
            run(smaller.attach(box.handle))
    finally:
        run(box.destroy())


def test_a_certificate_the_engine_did_not_sign_is_refused_naming_the_engine_without_secrets(fleet, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=intruder",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    good = fleet.config().engines[0]
    wrong = good.model_copy(update={"id": "stolen", "tls_cert": str(cert), "tls_key": str(key)})
    provider = FleetSandboxProvider(DockerSandboxConfig(engines=[wrong]))
    with pytest.raises(EngineUnreachable, match="engine 'stolen'") as err:
        run(provider.check())
    key_body = key.read_text().splitlines()[1]
    assert key_body not in str(err.value) and "PRIVATE KEY" not in str(err.value)
    # and a CA that did not sign the engine's certificate: the client refuses the engine
    wrong_ca = good.model_copy(update={"id": "spoofed", "tls_ca": str(cert)})
    with pytest.raises(EngineUnreachable, match="engine 'spoofed'.*CERTIFICATE_VERIFY_FAILED"):
        run(FleetSandboxProvider(DockerSandboxConfig(engines=[wrong_ca])).check())


def _client_certificate(fleet, folder: Path, name: str, valid_days: tuple[int, int]) -> tuple[Path, Path]:
    """A client key and certificate signed by the fleet's own CA, valid from `valid_days[0]` to `valid_days[1]`
    days from now (negative: in the past)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    certs = fleet.folder / "certs"
    ca_key = serialization.load_pem_private_key((certs / "ca-key.pem").read_bytes(), None)
    ca = x509.load_pem_x509_certificate((certs / "ca.pem").read_bytes())
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rollway client")]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now + datetime.timedelta(days=valid_days[0]))
            .not_valid_after(now + datetime.timedelta(days=valid_days[1]))
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    key_path, cert_path = folder / f"{name}-key.pem", folder / f"{name}-cert.pem"
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


def test_an_expired_client_certificate_is_refused_naming_the_engine_without_secrets(fleet, tmp_path):
    """The same CA, the same key type: a certificate inside its validity works, one past it is refused."""
    good = fleet.config().engines[0]
    key, cert = _client_certificate(fleet, tmp_path, "current", (-1, 1))
    run(FleetSandboxProvider(DockerSandboxConfig(engines=[good.model_copy(
        update={"id": "current", "tls_cert": str(cert), "tls_key": str(key)})])).check())
    key, cert = _client_certificate(fleet, tmp_path, "expired", (-10, -1))
    expired = good.model_copy(update={"id": "expired", "tls_cert": str(cert), "tls_key": str(key)})
    with pytest.raises(EngineUnreachable, match="engine 'expired'") as err:
        run(FleetSandboxProvider(DockerSandboxConfig(engines=[expired])).check())
    assert key.read_text().splitlines()[1] not in str(err.value) and "PRIVATE KEY" not in str(err.value)


def test_at_start_up_an_engine_that_does_not_answer_is_named_and_a_fleet_where_none_does_is_refused(fleet):
    """What `rollway up` calls before it starts a fleet run: it starts with the engines that answer (and names
    the one that does not), and refuses a run none of whose engines answers."""
    engines = fleet.config().engines
    dead = engines[0].model_copy(update={"id": "dead", "endpoint": f"tcp://127.0.0.1:{free_port()}"})
    down = check_engines(DockerSandboxConfig(engines=[*engines, dead]))
    assert list(down) == ["dead"] and "'dead'" in down["dead"]
    with pytest.raises(EngineUnreachable, match="no engine of sandbox.engines answers: .*'dead'"):
        check_engines(DockerSandboxConfig(engines=[dead]))


def test_a_full_fleet_makes_init_wait_and_places_on_the_engine_that_frees_up(fleet):
    """Capacity 1 per engine: three sandboxes fill the fleet, one on each engine; a fourth placement waits
    (back-pressure, not a failure) until one is destroyed, then lands on that engine."""
    one_each = [e.model_copy(update={"capacity": 1}) for e in fleet.config().engines]
    provider = FleetSandboxProvider(fleet.config().model_copy(update={"engines": one_each}))
    prefix = f"fleet-full-{uuid.uuid4().hex[:6]}"

    async def scenario():
        boxes = await asyncio.gather(*[provider.create(SandboxSpec(), f"{prefix}-{i}") for i in range(3)])
        assert sorted(b.handle["engine"] for b in boxes) == ["fleet-1", "fleet-2", "fleet-3"]
        # The metrics per engine: what each engine's own list holds (rollway_sandboxes_live), and each
        # creation counted on its engine while it ran (rollway_sandboxes_creating, 0 once done).
        live = await asyncio.to_thread(names_by_engine, provider, prefix)
        assert {e: len(names) for e, names in live.items()} == {"fleet-1": 1, "fleet-2": 1, "fleet-3": 1}
        assert {e: REGISTRY.get_sample_value("rollway_sandboxes_creating", {"stage": "init", "engine": e})
                for e in live} == dict.fromkeys(live, 0.0)
        waiting = asyncio.ensure_future(provider.create(SandboxSpec(), f"{prefix}-3"))
        done, _ = await asyncio.wait({waiting}, timeout=3.0)
        assert not done, "a placement on a full fleet must wait, not fail or overfill"
        freed = boxes.pop(1)
        await freed.destroy()
        fourth = await asyncio.wait_for(waiting, timeout=120)
        assert fourth.handle["engine"] == freed.handle["engine"]
        for b in [*boxes, fourth]:
            await b.destroy()

    run(scenario())


def test_a_daemon_killed_while_a_command_streams_fails_the_attempt_as_infrastructure(fleet):
    """The engine dies mid-exec: EngineUnreachable (infrastructure, re-issued), well before the command's
    time limit, never a hang and never an ordinary result a grader would score. The restarted engine's
    leftover (the container its restart stopped) is reaped when the fleet sees it answer again."""
    cfg = fleet.config()
    provider = FleetSandboxProvider(cfg.model_copy(update={"engines": [cfg.engines[2]]}))  # fleet-3 alone
    box = run(provider.create(SandboxSpec(), f"fleet-kill-{uuid.uuid4().hex[:6]}"))
    marker = f"{random.randint(100, 999)}.{random.randint(1000, 9999)}"
    result: dict = {}

    def streaming():
        start = time.monotonic()
        try:
            result["value"] = run(box.exec(f"echo started; sleep {marker}", timeout_s=120))
        except BaseException as err:  # noqa: BLE001 - the test inspects it
            result["error"] = err
        result["elapsed"] = time.monotonic() - start

    thread = threading.Thread(target=streaming)
    thread.start()
    wait_until(lambda: subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True).returncode == 0,
               timeout_s=60, what="the command running in the container")
    fleet.kill(3)
    thread.join(timeout=150)
    assert not thread.is_alive(), "the exec hung after its engine died"
    assert isinstance(result.get("error"), EngineUnreachable), result
    assert result["elapsed"] < 120, result
    with pytest.raises(EngineUnreachable):
        run(provider.attach(box.handle))
    fleet.up()  # restarts the killed daemon (idempotent for the others)
    wait_until(lambda: provider._choose("rollway-sandbox:bookworm") is not None, timeout_s=120,
               what="the fleet to see the engine again")
    provider.engines["fleet-3"].pending = 0
    assert box.name not in [n for names in fleet.live().values() for n in names]
    assert not [c for c in provider.engines["fleet-3"].provider.listed(LABEL)
                if c["Labels"][LABEL] == box.name], "the stopped sandbox of the dead daemon was not reaped"


def test_an_engine_without_the_image_pulls_it_from_the_registry_and_one_that_cannot_is_skipped(fleet):
    cfg = fleet.config()
    first = engine_client(cfg.engines[0])
    first.images.remove("rollway-sandbox:bookworm")  # the registry's tag keeps its layers: the pull is quick
    provider = FleetSandboxProvider(cfg.model_copy(update={"engines": [cfg.engines[0]]}))
    box = run(provider.create(SandboxSpec(), f"fleet-pull-{uuid.uuid4().hex[:6]}"))
    run(box.destroy())
    assert first.images.get("rollway-sandbox:bookworm")
    # without a registry, an engine lacking the image is skipped for it; the sandbox goes to one that has it
    first.images.remove("rollway-sandbox:bookworm")
    no_registry = FleetSandboxProvider(cfg.model_copy(update={"engines": cfg.engines[:2], "image_registry": None}))

    async def three():
        return await asyncio.gather(*[no_registry.create(SandboxSpec(), f"fleet-skip-{uuid.uuid4().hex[:6]}-{i}")
                                      for i in range(3)])

    boxes = run(three())
    assert {b.handle["engine"] for b in boxes} == {"fleet-2"}
    for b in boxes:
        run(b.destroy())
    for _ in range(2):  # the second placement meets the engines' "cannot get it" mark: an error, not a wait
        with pytest.raises(SandboxError, match="is on no engine of the fleet"):
            run(asyncio.wait_for(no_registry.create(SandboxSpec(image="rollway-no-such-image:1"), "fleet-nope"), 60))
    first.images.get(f"127.0.0.1:{fleet.reg_port}/rollway-sandbox:bookworm").tag("rollway-sandbox", "bookworm")
    first.close()


def test_fleet_up_again_after_the_image_changed_gives_every_engine_the_new_image(fleet, tmp_path):
    """`fleet-up.sh` is run again after `setup-docker.sh` rebuilt the sandbox image: the registry and the
    engines already hold an image of that tag, and must get the new one (it once pushed and pulled only
    what was missing by tag, so the engines kept running sandboxes from the old image)."""
    import docker

    main = docker.from_env()
    tag = f"rollway-fleet-probe:{uuid.uuid4().hex[:6]}"
    ids = []
    try:
        for content in ("one", "two"):
            (tmp_path / "f.txt").write_text(content)
            (tmp_path / "Dockerfile").write_text("FROM scratch\nCOPY f.txt /f.txt\n")
            image, _ = main.images.build(path=str(tmp_path), tag=tag, rm=True)
            ids.append(image.id)
            out = subprocess.run(["bash", str(ROOT / "scripts" / "fleet-up.sh"), "3"], capture_output=True, text=True,
                                 env={**fleet.env, "ROLLWAY_SANDBOX_IMAGE": tag}, timeout=900)
            assert out.returncode == 0, out.stderr[-3000:]
            for engine in fleet.config().engines:
                client = engine_client(engine)
                try:
                    assert client.images.get(tag).id == image.id, (engine.id, content)
                finally:
                    client.close()
        assert ids[0] != ids[1]
    finally:
        for engine in fleet.config().engines:
            with contextlib.suppress(Exception):
                client = engine_client(engine)
                client.images.remove(tag, force=True)
                client.close()
        for image_id in ids:
            with contextlib.suppress(Exception):
                main.images.remove(image_id, force=True)
        main.close()


# ---------------------------------------------------------------- an engine over ssh

@pytest.fixture(scope="module")
def sshd(fleet, tmp_path_factory):
    """A real sshd (Debian's openssh-server, installed when absent) on a loopback port, with a host key and an
    authorized client key made here, logging root in: root may open fleet-1's unix socket, so the ssh://
    engine is fleet-1's daemon reached as another host's would be. Yields (engine config, key folder)."""
    if not Path("/usr/sbin/sshd").exists():
        subprocess.run(["apt-get", "install", "-y", "-qq", "-o", "DPkg::Lock::Timeout=600", "openssh-server"],
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}, check=True, capture_output=True,
                       timeout=900)
    keys = tmp_path_factory.mktemp("ssh")
    for key in ("host", "client", "stranger"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / key)], check=True)
    (keys / "authorized_keys").write_text((keys / "client.pub").read_text())
    port = free_port()
    (keys / "sshd_config").write_text(
        f"ListenAddress 127.0.0.1\nPort {port}\nHostKey {keys / 'host'}\n"
        f"AuthorizedKeysFile {keys / 'authorized_keys'}\nPidFile {keys / 'sshd.pid'}\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
        "PermitRootLogin prohibit-password\nStrictModes no\n")
    (keys / "known_hosts").write_text(f"[127.0.0.1]:{port} {(keys / 'host.pub').read_text()}")
    os.makedirs("/run/sshd", exist_ok=True)  # its privilege separation folder
    with open(keys / "sshd.log", "wb") as log:
        sshd = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(keys / "sshd_config")], stderr=log)
    try:
        wait_until(lambda: port_open(port), timeout_s=60, what="sshd listening")
        socket_path = f"/run/{fleet.folder.name}/e1/docker.sock"  # fleet-up.sh's unix socket of engine 1
        yield EngineConfig(id="over-ssh", endpoint=f"ssh://root@127.0.0.1:{port}{socket_path}",
                           ssh_key=str(keys / "client"), ssh_known_hosts=str(keys / "known_hosts")), keys
    finally:
        sshd.terminate()
        sshd.wait(timeout=60)


def test_an_ssh_engine_runs_sandboxes_through_a_real_sshd_and_shows_in_the_fleet_status(fleet, sshd, tmp_path):
    """Create, exec, destroy on an ssh:// engine: its socket forwarded by the system's ssh client through a real
    sshd, the container on fleet-1's daemon. A tunnel that ended (killed here) is started again at the next
    request. `rollway sandbox fleet` shows the engine up. The key's contents are nowhere: not in the handle,
    ssh's argv (its path only) or the status output."""
    engine, keys = sshd
    secret = (keys / "client").read_text().splitlines()[1]
    provider = FleetSandboxProvider(fleet.config().model_copy(update={"engines": [engine]}))
    box = run(provider.create(SandboxSpec(files={"a.txt": "over ssh"}), f"fleet-tunnel-{uuid.uuid4().hex[:6]}"))
    try:
        assert box.handle["engine"] == "over-ssh" and not any(k in json.dumps(box.handle) for k in ("ssh:", str(keys)))
        assert box.name in fleet.live()["fleet-1"]  # the same daemon, seen through its TLS endpoint
        tunnel = provider.engines["over-ssh"].provider.client.tunnel
        argv = Path(f"/proc/{tunnel.proc.pid}/cmdline").read_text().split("\0")
        assert f"IdentityFile={keys / 'client'}" in argv and not any(secret in a for a in argv), argv
        assert run(box.exec("cat a.txt")).output == "over ssh"
        os.kill(tunnel.proc.pid, signal.SIGKILL)
        wait_until(lambda: not tunnel.alive, timeout_s=30, what="the killed ssh to be reaped")
        assert run(box.exec("echo again")).output == "again\n"
        assert provider.engines["over-ssh"].provider.client.tunnel is not tunnel and not os.path.exists(tunnel.folder)
    finally:
        run(box.destroy())
    assert box.name not in fleet.live()["fleet-1"]
    config = tmp_path / "ssh.yaml"
    engines = [engine.model_dump(exclude_none=True)]
    config.write_text(yaml.safe_dump({"sandbox": {"type": "docker", "engines": engines}}))
    out = subprocess.run([sys.executable, "-m", "rollway.runners", "sandbox", "fleet", str(config), "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    [row] = json.loads(out.stdout)
    assert (row["id"], row["state"]) == ("over-ssh", "up") and "rollway-sandbox:bookworm" in row["images"], row
    assert secret not in out.stdout + out.stderr


def test_an_ssh_engine_refuses_a_key_it_does_not_authorize_and_a_host_key_it_does_not_know(fleet, sshd, tmp_path):
    """A client key the host does not authorize, a host whose key is not in ssh_known_hosts, and one whose key
    differs from the one there (a host spoofing the engine's): refused with the engine's id and ssh's reason,
    no secret in the message, never a prompt or a key accepted on first use."""
    engine, keys = sshd
    (tmp_path / "empty").write_text("")
    host_line = (keys / "known_hosts").read_text().split(" ")[0]
    (tmp_path / "changed").write_text(f"{host_line} {(keys / 'stranger.pub').read_text()}")
    cases = {"stranger": ({"ssh_key": str(keys / "stranger")}, r"Permission denied \(publickey\)"),
             "unknown-host": ({"ssh_known_hosts": str(tmp_path / "empty")}, "Host key verification failed"),
             "changed-host": ({"ssh_known_hosts": str(tmp_path / "changed")}, "Host key verification failed")}
    for engine_id, (update, reason) in cases.items():
        wrong = engine.model_copy(update={"id": engine_id, **update})
        with pytest.raises(EngineUnreachable, match=f"engine '{engine_id}'.*{reason}") as err:
            run(FleetSandboxProvider(DockerSandboxConfig(engines=[wrong])).check())
        for key in ("client", "stranger", "host"):
            assert (keys / key).read_text().splitlines()[1] not in str(err.value)
        assert "PRIVATE KEY" not in str(err.value)


def test_an_ssh_tunnel_cut_while_a_command_streams_fails_the_attempt_as_infrastructure(fleet, sshd):
    """The ssh process is killed while a command streams (the host's network cut): the stream ends without the
    command's end while the command still runs. That is the connection's failure, not a result: the exec raises
    EngineUnreachable (the attempt fails as infrastructure) well before the command's own end, never an
    ordinary result a grader would score. Cut four times: the next request either meets the dead tunnel's
    socket or (as often) already opens a new tunnel, and finds the command still running; before the fix
    that second case returned exit code -1 with the output so far. A request that meets the dead tunnel fails as infrastructure
    before its command runs; it is sent again (that is not a cut)."""
    engine, _keys = sshd
    provider = FleetSandboxProvider(fleet.config().model_copy(update={"engines": [engine]}))
    box = run(provider.create(SandboxSpec(), f"fleet-cut-{uuid.uuid4().hex[:6]}"))
    try:
        cuts = refused = 0
        while cuts < 4:
            marker = f"{random.randint(100, 999)}.{random.randint(1000, 9999)}"
            result: dict = {}

            def streaming(command=f"echo started; sleep {marker}", result=result):
                start = time.monotonic()
                try:
                    result["value"] = run(box.exec(command, timeout_s=120))
                except BaseException as err:  # noqa: BLE001 - the test inspects it
                    result["error"] = err
                result["elapsed"] = time.monotonic() - start

            thread = threading.Thread(target=streaming)
            thread.start()
            wait_until(lambda m=marker, t=thread: not t.is_alive() or subprocess.run(
                ["pgrep", "-f", f"sleep {m}"], capture_output=True).returncode == 0, timeout_s=120,
                       what="the command running in the container, or its exec's end")
            if not thread.is_alive():  # the request met the last cut's dead tunnel before the command ran:
                assert isinstance(result.get("error"), EngineUnreachable), result  # infrastructure too
                refused += 1
                assert refused <= 8, "the engine stayed unreachable after its tunnel was cut"
                continue
            cuts += 1
            os.kill(provider.engines["over-ssh"].provider.client.tunnel.proc.pid, signal.SIGKILL)
            thread.join(timeout=150)
            assert not thread.is_alive(), "the exec hung after its tunnel was cut"
            assert isinstance(result.get("error"), EngineUnreachable), result
            assert result["elapsed"] < float(marker), result
        for _ in range(8):  # the engine itself is fine: a new tunnel (the first request may meet the dead one,
            try:             # and fails as infrastructure, as in the loop above)
                assert run(box.exec("echo fine")).output == "fine\n"
                break
            except EngineUnreachable:
                continue
        else:
            raise AssertionError("the engine stayed unreachable after its tunnel was cut")
    finally:
        run(box.destroy())


def test_a_job_on_an_ssh_engine_completes_and_its_stage_workers_tunnels_end_with_them(fleet, sshd, tmp_path, broker):
    """The smoke job with the ssh:// engine as the whole fleet, every stage its own process (DOCKER_HOST points
    nowhere): each init, agent and reward worker opens its own tunnel and reattaches by the engine's id.
    Judged from the topics; afterwards no ssh tunnel of those workers is left running."""
    engine, _keys = sshd
    verdict, seen = _job(fleet, tmp_path, broker, "tunnel", episodes_per_task=2, tasks=3,
                         engines=[engine.model_dump(exclude_none=True)])
    assert verdict["scheduled"] == 6 and verdict["completed"] == 6, verdict
    assert verdict["lost"] == 0 and verdict["duplicated"] == 0 and verdict["graded_twice"] == 0, verdict
    assert {e for e, names in seen.items() if names} == {"fleet-1"}, seen  # the ssh engine's daemon

    def others_tunnels() -> list[str]:  # ssh tunnels not started by this test process (the workers' ones)
        found = []
        for proc in Path("/proc").glob("[0-9]*"):
            with contextlib.suppress(OSError):
                argv = (proc / "cmdline").read_bytes().split(b"\0")
                parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if argv[0] == b"ssh" and any(b"/rollway-ssh-" in a for a in argv) and parent != os.getpid():
                    found.append(proc.name)
        return found

    wait_until(lambda: not others_tunnels(), timeout_s=60, what="the stage workers' ssh tunnels to end")


# ---------------------------------------------------------------- an engine out of disk

def test_an_engine_out_of_disk_loses_no_episode_and_the_fleet_status_says_so(fleet, tmp_path, broker):
    """A fourth engine (fleet-up.sh 4) whose data root is a small tmpfs, filled once it holds the image: it
    answers, but cannot create a container ("no space left on device"). A job over it and fleet-1..3: every
    episode completes on the others, none failed or re-issued for the disk (the fleet places the sandbox
    again, elsewhere, and skips the engine); `rollway sandbox fleet` says it is out of disk."""
    data = fleet.folder / "e4" / "data"
    data.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1200m", "tmpfs", str(data)], check=True)
    try:
        out = subprocess.run(["bash", str(ROOT / "scripts" / "fleet-up.sh"), "4"], env=fleet.env, capture_output=True,
                             text=True, timeout=900)
        assert out.returncode == 0, out.stderr[-3000:]
        engines = yaml.safe_load(out.stdout.splitlines()[0].split("=", 1)[1])
        full = next(e for e in engines if e["id"] == "fleet-4")
        subprocess.run(["dd", "if=/dev/zero", f"of={data}/filler", "bs=1M"], capture_output=True)  # to ENOSPC
        verdict, seen = _job(fleet, tmp_path, broker, "disk", episodes_per_task=2, tasks=6, extra_engines=(full,))
        assert verdict["scheduled"] == 12 and verdict["completed"] == 12, verdict
        assert verdict["failed"] == 0 and verdict["lost"] == 0 and verdict["duplicated"] == 0, verdict
        init_log = (tmp_path / "disk" / "logs" / "init.jsonl").read_text().splitlines()
        skipped = [json.loads(line) for line in init_log if "out of disk; placements skip it" in line]
        assert skipped and {e["engine"] for e in skipped} == {"fleet-4"}, init_log[-20:]
        assert verdict["attempts"] == 12, verdict  # no attempt failed for the disk: nothing re-issued
        config = tmp_path / "disk-fleet.yaml"
        config.write_text(yaml.safe_dump({"sandbox": {"type": "docker", "engines": engines}}))
        status = subprocess.run([sys.executable, "-m", "rollway.runners", "sandbox", "fleet", str(config), "--json"],
                                cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert status.returncode == 1, status.stderr[-3000:]  # not every engine is usable
        rows = {r["id"]: r for r in json.loads(status.stdout)}
        assert {k: r["state"] for k, r in rows.items()} == {"fleet-1": "up", "fleet-2": "up", "fleet-3": "up",
                                                            "fleet-4": "out of disk"}, rows
        assert "no space left on device" in rows["fleet-4"]["reason"], rows["fleet-4"]
    finally:  # engine 4 stopped and its tmpfs gone; fleet-up.sh 3 makes the settings the module's again
        with contextlib.suppress(FileNotFoundError, ProcessLookupError, ValueError):
            pid = int((fleet.folder / "e4" / "dockerd.pid").read_text())
            os.kill(pid, signal.SIGTERM)
            wait_until(lambda: not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2]
                       == "Z", timeout_s=120, what="engine 4's daemon to stop")
        subprocess.run(["umount", "-l", str(data)], capture_output=True)
        fleet.up()


# ---------------------------------------------------------------- jobs: stages as separate processes

def _job(fleet, tmp_path, broker, name: str, episodes_per_task: int, tasks: int, watch=None,
         extra_engines: tuple[dict, ...] = (), init_workers: int = 1, init_concurrency: int | None = None,
         engines: list[dict] | None = None) -> tuple[dict, dict]:
    """`rollway up` of the smoke job on the fleet, every stage its own process; DOCKER_HOST points at no
    engine, so the engines are reached only through their TCP endpoints. Returns (ledger verdict, the
    sandboxes each engine was seen holding)."""
    from rollway.runners.chaos import Ledger

    run_id = f"{name}{uuid.uuid4().hex[:6]}"
    cfg = yaml.safe_load((ROOT / "examples" / "smoke.yaml").read_text())
    cfg["run"].update(id=run_id, timeout_s=400)
    cfg["tasks"]["count"], cfg["scheduler"]["group_size"] = tasks, episodes_per_task
    cfg["scheduler"].update(max_inflight_episodes=tasks * episodes_per_task, episode_deadline_s=120, max_attempts=4)
    cfg["runtime"] = {"processes": "per-stage"}
    if init_concurrency is not None:
        cfg["init"]["concurrency"] = init_concurrency
    cfg["sandbox"] = fleet.config().model_dump(mode="json", exclude_defaults=True) | {"type": "docker"}
    cfg["sandbox"]["engines"] = (engines or cfg["sandbox"]["engines"]) + list(extra_engines)
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump(cfg))
    seen: dict[str, set[str]] = {}
    peak: dict[str, int] = {}
    stop = threading.Event()

    def monitor():
        while not stop.is_set():
            for engine, names in fleet.live().items():
                mine = [n for n in names if n.startswith(run_id)]
                seen.setdefault(engine, set()).update(mine)
                peak[engine] = max(peak.get(engine, 0), len(mine))
                if watch is not None:
                    watch(engine, mine)
            stop.wait(0.2)

    watcher = threading.Thread(target=monitor, daemon=True)
    watcher.start()
    env = {**os.environ, "DOCKER_HOST": "unix:///nonexistent/docker.sock", "PYTHONUNBUFFERED": "1"}
    topics = f"topics.prefix={name}{uuid.uuid4().hex[:6]}-"
    try:
        out = subprocess.run([sys.executable, "-m", "rollway.runners", "up", str(config), "--bootstrap", broker.bootstrap,
                              "--run-dir", str(tmp_path / name), "--no-report", "--workers", f"init={init_workers}",
                              topics],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    finally:
        stop.set()
        watcher.join()
    assert out.returncode == 0, out.stderr[-4000:]
    ledger = Ledger(load_config(config, [topics]), broker.bootstrap)
    ledger.poll()
    verdict = ledger.judge(tmp_path / name, trains=False)
    verdict["peak"], verdict["run_id"], verdict["output"] = peak, run_id, out.stdout + out.stderr
    return verdict, seen


def test_a_job_over_three_engines_is_balanced_and_never_overfills_one_past_the_bound(fleet, tmp_path, broker):
    """12 episodes, room for 3 sandboxes per engine (9 at once), two init processes placing at once, each
    creating at most F = init.concurrency = 1 sandbox at a time: init places on the engine with the most room
    and waits while all are full, and no engine ever holds more than the stated bound, capacity + (W - 1) * F
    (sandboxes/fleet.py). A fourth engine that never answers is named at start-up and avoided; the run goes
    on with the rest."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # nothing listens there once the socket is closed
    ghost = {"id": "ghost", "endpoint": f"tcp://127.0.0.1:{closed}", "capacity": 3}
    verdict, seen = _job(fleet, tmp_path, broker, "balanced", episodes_per_task=2, tasks=6, extra_engines=(ghost,),
                         init_workers=2, init_concurrency=1)
    assert "sandbox engine ghost does not answer" in verdict["output"]
    assert verdict["scheduled"] == 12 and verdict["completed"] == 12 and verdict["lost"] == 0, verdict
    assert verdict["graded_twice"] == 0
    per_engine = {e: len(n) for e, n in seen.items()}
    assert set(per_engine) == {"fleet-1", "fleet-2", "fleet-3"} and min(per_engine.values()) >= 2, per_engine
    started = [line for line in (tmp_path / "balanced" / "logs" / "init.jsonl").read_text().splitlines()
               if json.loads(line).get("event") == "stage worker started"]
    assert len(started) == 2  # two init processes placed side by side
    assert max(verdict["peak"].values()) <= CAPACITY + (2 - 1) * 1, verdict["peak"]
    assert not [n for names in fleet.live().values() for n in names if n.startswith(verdict["run_id"])]


def test_a_job_during_which_an_engines_daemon_is_killed_loses_and_duplicates_nothing(fleet, tmp_path, broker):
    """fleet-2's daemon is SIGKILLed once it holds a sandbox of the job: its episodes fail as infrastructure
    and are re-issued on the other engines; every episode is completed or counted failed."""
    killed = threading.Event()

    def kill_when_busy(engine: str, mine: list[str]) -> None:
        if engine == "fleet-2" and mine and not killed.is_set():
            killed.set()
            fleet.kill(2)

    try:
        verdict, seen = _job(fleet, tmp_path, broker, "killed", episodes_per_task=2, tasks=6, watch=kill_when_busy)
    finally:
        fleet.up()  # the killed engine back, for the module's other tests
    assert killed.is_set()
    assert verdict["scheduled"] == 12 and verdict["completed"] + verdict["failed"] == 12, verdict
    assert verdict["lost"] == 0 and verdict["duplicated"] == 0 and verdict["graded_twice"] == 0, verdict
    assert verdict["attempts"] > 12, verdict  # the killed engine's episodes were issued again
    assert verdict["completed"] >= 10, verdict


def test_mini_swe_agent_on_another_hosts_engine_reaches_its_worker_through_the_relay(fleet, tmp_path, broker):
    """mini-swe-agent (the real program) plays a toy task in a container on a fleet engine reached over TLS:
    such an engine is taken to be another host's, so no folder of this host is bound into the container for
    the gateway (its socket reaches the container through the keeper's relay on an exec stream,
    sandboxes/relay.py). The program's calls are captured and the task is resolved. Its install folder is
    still bound from this host (the fleet's daemons run here; on another host the program would be in the
    image). The scripted policy is the model (the only fake)."""
    from agent_programs import mini_harness, mini_swe_agent
    from test_harness import MINI_FIX

    from rollway.sandboxes.docker import GATEWAY_DIR

    run_id = f"relay{uuid.uuid4().hex[:6]}"
    harness = mini_harness(mini_swe_agent(), own_python=True, configs=["mini_textbased.yaml", "environment.cwd=/workspace"])
    harness.update(time_limit_s=420, silence_limit_s=420)
    cfg = {"run": {"name": "relay", "id": run_id, "timeout_s": 600}, "tasks": {"type": "toy", "count": 1},
           "scheduler": {"group_size": 1, "max_inflight_episodes": 1, "episode_deadline_s": 540, "max_attempts": 1},
           "agent": {"concurrency": 1, "harness": harness},
           "policy": {"type": "scripted", "chat_format": "bytes-chatml", "script": MINI_FIX},
           "sandbox": fleet.config().model_dump(mode="json", exclude_defaults=True)
           | {"type": "docker", "gateway_root": str(tmp_path / "gw")}}
    config = tmp_path / "relay.yaml"
    config.write_text(yaml.safe_dump(cfg))
    mounts: dict[str, list] = {}
    stop = threading.Event()

    def watch() -> None:  # what each container of the run has at GATEWAY_DIR, from its engine
        while not stop.is_set():
            for engine in fleet.config().engines:
                with contextlib.suppress(Exception):
                    client = engine_client(engine)
                    for c in client.api.containers(filters={"label": LABEL}):
                        if (c.get("Labels") or {}).get(LABEL, "").startswith(run_id):
                            info = client.api.inspect_container(c["Id"])
                            mounts[c["Id"]] = [[m["Type"] for m in info["Mounts"] if m["Destination"] == GATEWAY_DIR],
                                               GATEWAY_DIR in (info["HostConfig"].get("Tmpfs") or {})]
                    client.close()
            stop.wait(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    env = {**os.environ, "DOCKER_HOST": "unix:///nonexistent/docker.sock", "PYTHONUNBUFFERED": "1"}
    try:
        out = subprocess.run([sys.executable, "-m", "rollway.runners", "up", str(config), "--bootstrap",
                              broker.bootstrap, "--run-dir", str(tmp_path / "run"), "--no-report",
                              f"topics.prefix={run_id}-"], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=900)
    finally:
        stop.set()
        watcher.join()
    assert out.returncode == 0, out.stderr[-4000:]
    trajs = [json.loads(line) for line in (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()]
    assert [(t["resolved"], t["stop_reason"], t["num_turns"]) for t in trajs] == [(True, "harness_exit", 2)], \
        out.stderr[-3000:]
    assert mounts and all(m == [[], True] for m in mounts.values()), mounts  # no bind, the keeper's tmpfs
    assert not list((tmp_path / "gw").glob("*/gateway.sock"))  # the relay's host folder went with the episode


def test_chaos_kills_a_sandbox_engine_holding_episodes_and_they_move_to_the_others(fleet, tmp_path):
    """`rollway chaos --fleet-dir DIR --kinds sandbox-engine` on the smoke job spread over the fleet: the
    daemon of an engine holding sandboxes of the run is SIGKILLed and started again by fleet-up.sh. Judged
    from the topics: nothing lost or duplicated, the episodes it held were issued again and completed (moved),
    with the seconds from the kill to each re-issue reported; afterwards every engine answers again."""
    cfg = yaml.safe_load((ROOT / "examples" / "smoke.yaml").read_text())
    cfg["run"]["timeout_s"] = 600
    cfg["tasks"]["count"], cfg["scheduler"]["group_size"] = 6, 2
    cfg["scheduler"].update(max_inflight_episodes=12, episode_deadline_s=120, max_attempts=4)
    cfg["sandbox"] = fleet.config().model_dump(mode="json", exclude_defaults=True) | {"type": "docker"}
    config = tmp_path / "chaos-fleet.yaml"
    config.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "DOCKER_HOST": "unix:///nonexistent/docker.sock", **fleet.env}
    try:
        out = subprocess.run([sys.executable, "-m", "rollway.runners", "chaos", str(config), "--json", "--seed", "3",
                              "--run-dir", str(tmp_path / "run"), "--fleet-dir", str(fleet.folder), "--kinds",
                              "sandbox-engine", "--max-kills", "1", "--min-gap", "0.5", "--max-gap", "1.0",
                              "--faults", "none", "--fleet-restart-after", "3"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    finally:
        fleet.up()  # whatever happened, the module's engines back
    assert out.stdout.strip(), out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0, json.dumps({k: v for k, v in result.items() if k != "events"})[:6000]
    assert result["scheduled"] == 12 and result["completed"] + result["failed"] == 12, result
    assert result["lost"] == 0 and result["duplicated"] == 0 and result["graded_twice"] == 0, result
    assert result["sandbox_engine_restarts"][-1]["exit"] == 0, result["sandbox_engine_restarts"]
    [kill] = result["sandbox_engine_kills"]
    assert kill["episodes"] >= 1 and kill["moved"] >= 1 and result["episodes_moved"] == kill["moved"], result
    assert len(kill["reissued_after_s"]) >= kill["moved"] and min(kill["reissued_after_s"]) >= 0, kill
    assert set(fleet.live()) == {"fleet-1", "fleet-2", "fleet-3"}  # the killed engine was started again
