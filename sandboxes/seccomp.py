"""A seccomp filter for local jails, as a classic BPF program that bubblewrap loads (`--seccomp FD`).

Refused with EPERM: new namespaces (unshare, setns, clone with any CLONE_NEW* flag: no nested user
namespaces), mount and the new mount API, ptrace and cross-process memory access, the kernel
keyring, bpf, perf events, kernel modules, kexec, reboot, swap, quotas, syslog, userfaultfd. clone3
answers ENOSYS so that libc falls back to clone, whose flags a classic filter can read. Syscalls of
other ABIs (i386, x32) are refused. Built here in Python (no libseccomp needed); x86_64 only:
elsewhere `filter_program()` returns None and the jail runs without a filter."""

from __future__ import annotations

import errno
import json
import platform
import struct

_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_BIT = 0x40000000
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_LD_ABS_W, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_CLONE, _CLONE3 = 56, 435
_CLONE_NEW_FLAGS = 0x7E020000  # NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
_REFUSED_X86_64 = {
    "ptrace": 101, "syslog": 103, "vhangup": 153, "pivot_root": 155, "acct": 163, "mount": 165,
    "umount2": 166, "swapon": 167, "swapoff": 168, "reboot": 169, "iopl": 172, "ioperm": 173,
    "init_module": 175, "delete_module": 176, "quotactl": 179, "lookup_dcookie": 212,
    "kexec_load": 246, "add_key": 248, "request_key": 249, "keyctl": 250, "unshare": 272,
    "perf_event_open": 298, "name_to_handle_at": 303, "open_by_handle_at": 304, "setns": 308,
    "process_vm_readv": 310, "process_vm_writev": 311, "finit_module": 313, "kexec_file_load": 320,
    "bpf": 321, "userfaultfd": 323, "open_tree": 428, "move_mount": 429, "fsopen": 430,
    "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
}  # fmt: skip
"""Refused syscalls by x86_64 number."""


def filter_program() -> bytes | None:
    """The filter as `struct sock_filter[]` bytes, or None where this host is not x86_64."""
    if platform.machine() != "x86_64":
        return None
    deny, enosys, clone = "deny", "enosys", "clone"
    prog: list[tuple[int, object, object, int] | str] = [
        (_LD_ABS_W, 0, 0, 4),  # seccomp_data.arch
        (_JEQ, 1, deny, _AUDIT_ARCH_X86_64),
        (_RET, 0, 0, _RET_ERRNO | errno.EPERM),  # never reached: keeps the next index a jump target
        (_LD_ABS_W, 0, 0, 0),  # seccomp_data.nr
        (_JGE, deny, 0, _X32_BIT),
        *[(_JEQ, deny, 0, nr) for nr in sorted(_REFUSED_X86_64.values())],
        (_JEQ, enosys, 0, _CLONE3),
        (_JEQ, clone, 0, _CLONE),
        (_RET, 0, 0, _RET_ALLOW),
        clone,
        (_LD_ABS_W, 0, 0, 16),  # low 32 bits of args[0]: the clone flags
        (_JSET, deny, 0, _CLONE_NEW_FLAGS),
        (_RET, 0, 0, _RET_ALLOW),
        enosys,
        (_RET, 0, 0, _RET_ERRNO | errno.ENOSYS),
        deny,
        (_RET, 0, 0, _RET_ERRNO | errno.EPERM),
    ]
    return _assemble(prog)


def _assemble(prog: list) -> bytes:
    """Resolve label names (strings placed before their instruction) into forward jump offsets."""
    labels: dict[str, int] = {}
    insns: list[tuple[int, object, object, int]] = []
    for item in prog:
        if isinstance(item, str):
            labels[item] = len(insns)
        else:
            insns.append(item)
    out = bytearray()
    for i, (code, jt, jf, k) in enumerate(insns):
        jt_off = labels[jt] - i - 1 if isinstance(jt, str) else int(jt)  # type: ignore[arg-type]
        jf_off = labels[jf] - i - 1 if isinstance(jf, str) else int(jf)  # type: ignore[arg-type]
        if not (0 <= jt_off < 256 and 0 <= jf_off < 256):
            raise ValueError(f"jump out of range at instruction {i}")
        out += struct.pack("<HBBI", code, jt_off, jf_off, k)
    return bytes(out)


def docker_profile() -> str:
    """The same refusals as a Docker seccomp profile (JSON, for `security_opt=["seccomp=..."]`): everything
    else allowed, the syscalls above refused with EPERM by name (the engine resolves names for its own
    architecture), clone with a CLONE_NEW* flag refused, clone3 answered ENOSYS. It replaces Docker's
    default profile, which allows ptrace, process_vm_readv and process_vm_writev: with it, no process of
    a container can trace or read another's memory through those calls (/proc/PID/mem is closed apart,
    by making rollway's processes non-dumpable: sandboxes/docker.py)."""
    eperm = {"action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM}
    rules = [
        {"names": sorted(_REFUSED_X86_64), **eperm},
        {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS},
        # One rule per CLONE_NEW* bit (MASKED_EQ compares one masked value): any of them set is refused.
        *({"names": ["clone"], **eperm, "args": [{"index": 0, "value": bit, "valueTwo": bit, "op": "SCMP_CMP_MASKED_EQ"}]}
          for bit in (1 << i for i in range(32) if _CLONE_NEW_FLAGS >> i & 1)),
    ]
    return json.dumps({"defaultAction": "SCMP_ACT_ALLOW", "syscalls": rules}, separators=(",", ":"))

