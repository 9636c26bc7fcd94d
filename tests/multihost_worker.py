"""One process of the multi-host test: join the job, generate on the global 2x4 mesh, print the tokens.

Run by tests/test_multihost.py through `jaxspec.distributed.launch_local` (2 processes x 4 CPU devices).
"""

import json
import sys

from jaxspec.distributed import initialize_from_env


def main() -> None:
    info = initialize_from_env()  # before any other JAX call
    import jax

    from jaxspec.engine import Engine
    from model.sharding import make_mesh
    from tests.sharded_pair import MAX_NEW, NUM_STEPS, PROMPTS_8, sharded_pair

    cfg, w = sharded_pair()
    mesh = make_mesh((2, 4))  # "data" across the two processes, "model" within each
    result = Engine(cfg, w, num_steps=NUM_STEPS, mesh=mesh).generate(PROMPTS_8, MAX_NEW)
    print(json.dumps({"process": info.process_id, "processes": info.num_processes,
                      "devices": jax.device_count(), "local_devices": jax.local_device_count(),
                      "tokens": result.tokens}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
