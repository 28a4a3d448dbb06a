"""One process of tests/parallel/test_row_parallel.py's two-process case (not a test module).

  python -m tests.multiprocess_case PROCESS_ID PORT OUT.npz

Each of 2 processes has 4 CPU devices; jax.distributed joins them (CPU collectives over gloo) into
one mesh of 8 devices with the rows split over all of them (Explicit axes, the parameters placed
on the mesh). Both compute a
TriangleAttention (ending node: all-to-alls across the processes) training step with
global_config.shard_rows_over; process 0 writes the update and the gradients, gathered.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from tests import row_parallel_case  # noqa: E402


def main(process_id: int, port: int, out: str) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id
    )
    mesh = jax.make_mesh((8,), ("rows",), axis_types=(AxisType.Explicit,))
    params, args = row_parallel_case.problem()

    def place(x, spec):
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    params = jax.tree.map(lambda x: place(np.asarray(x), P()), params)
    args = [place(np.asarray(x), P("rows")) for x in args]
    step = jax.jit(row_parallel_case.step(shard_rows_over="rows"))
    with jax.set_mesh(mesh):
        result = step(params, *args)
    leaves = [np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in
              jax.tree.leaves(result)]  # fmt: skip
    if process_id == 0:
        np.savez(out, *leaves)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
