"""Multi-host runs through JAX's own runtime (`jax.distributed.initialize`).

Every process runs the same program (SPMD): after `initialize`, `jax.devices()` lists the devices of ALL
processes, so `make_mesh` builds the global mesh, `Engine(..., mesh=mesh)` places weights on it (each
process filling its own devices' shards) and every process gets the same tokens back.

From a CLI: call `initialize_from_env()` first thing (before any other JAX call); it reads
JAXSPEC_COORDINATOR (host:port), JAXSPEC_NUM_PROCESSES and JAXSPEC_PROCESS_ID and does nothing when they
are unset. `launch_local` (or `python -m jaxspec.distributed --processes 2 --cpu-devices 4 -- CMD...`)
starts such processes on this host, for tests and for trying multi-host code on one CPU machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import subprocess
import sys
import tempfile
import time

import jax

ENV_COORDINATOR = "JAXSPEC_COORDINATOR"
ENV_NUM_PROCESSES = "JAXSPEC_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXSPEC_PROCESS_ID"


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    process_id: int
    num_processes: int
    local_devices: int
    global_devices: int


def initialize(coordinator_address: str, num_processes: int, process_id: int) -> ProcessInfo:
    """Join the job; CPU devices talk through gloo (XLA's CPU collectives; without it, cross-process
    collectives on CPU fail)."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)
    return ProcessInfo(jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count())


def initialize_from_env(environ=None) -> ProcessInfo | None:
    """`initialize` from JAXSPEC_* variables (set by `launch_local` or a cluster script); None when unset."""
    env = os.environ if environ is None else environ
    if ENV_COORDINATOR not in env:
        return None
    return initialize(env[ENV_COORDINATOR], int(env[ENV_NUM_PROCESSES]), int(env[ENV_PROCESS_ID]))


DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(command: list[str], num_processes: int, cpu_devices: int, *, timeout: float | None = None,
                 env: dict | None = None) -> list[subprocess.CompletedProcess]:
    """Run `command` as `num_processes` processes on this host, each with `cpu_devices` CPU devices and a
    coordinator on 127.0.0.1; returns each process's result (stdout / stderr captured as text). The environment's
    XLA_FLAGS are kept, but for a device count of their own."""
    coordinator = f"127.0.0.1:{free_port()}"
    procs, logs = [], []
    for pid in range(num_processes):
        penv = dict(os.environ if env is None else env)
        kept = [f for f in penv.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
        penv.update({
            ENV_COORDINATOR: coordinator, ENV_NUM_PROCESSES: str(num_processes), ENV_PROCESS_ID: str(pid),
            "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(kept + [f"{DEVICE_COUNT_FLAG}={cpu_devices}"]),
        })
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # files: a pipe can fill and block
        logs.append((out, err))
        procs.append(subprocess.Popen(command, env=penv, stdout=out, stderr=err, text=True))
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(None if deadline is None else max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:  # one failed process can leave the others waiting on the coordinator
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for p, (out, err) in zip(procs, logs):
        out.seek(0)
        err.seek(0)
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read()))
        out.close()
        err.close()
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxspec.distributed", description=launch_local.__doc__)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--cpu-devices", type=int, default=4, help="CPU devices per process")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command every process runs")
    a = p.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        p.error("no command given")
    status = 0
    for pid, r in enumerate(launch_local(command, a.processes, a.cpu_devices)):
        sys.stdout.write(r.stdout)
        sys.stderr.write(r.stderr)
        status = status or r.returncode
    return status


if __name__ == "__main__":
    sys.exit(main())
