"""Multi-host: 2 processes x 4 CPU devices joined by jax.distributed generate what one process does."""

import json
import os
import sys
from pathlib import Path

from jaxspec.distributed import launch_local
from tests.sharded_pair import single_device_run

REPO = Path(__file__).resolve().parent.parent


def test_two_processes_generate_the_one_process_tokens():
    # the workers keep conftest's compile options: launch_local replaces only XLA_FLAGS' device count
    results = launch_local([sys.executable, "-m", "tests.multihost_worker"], num_processes=2, cpu_devices=4,
                           timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    for r in results:
        assert r.returncode == 0, r.stderr[-4000:]
    reports = [json.loads(r.stdout.strip().splitlines()[-1]) for r in results]
    layout = [(x["process"], x["processes"], x["devices"], x["local_devices"]) for x in reports]
    assert layout == [(0, 2, 8, 4), (1, 2, 8, 4)]
    one_process = single_device_run("cycle")[2]
    assert reports[0]["tokens"] == reports[1]["tokens"] == one_process


def test_launch_local_keeps_the_callers_xla_flags_but_the_device_count():
    env = {**os.environ, "XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=8"}
    (r,) = launch_local([sys.executable, "-c", "import os; print(os.environ['XLA_FLAGS'])"], num_processes=1,
                        cpu_devices=3, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["--xla_backend_optimization_level=0", "--xla_force_host_platform_device_count=3"]
