"""A process that creates the default group again (one backend after another in one job)
under torchrun: four gloo processes, with megatron's tensor x pipeline groups when
megatron-core is installed, else the same sub-groups by hand."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = """
import torch
import torch.distributed as dist

from reasonctl.backends.distributed import init_process_group

try:
    from megatron.core import parallel_state
except ImportError:
    parallel_state = None

for generation in range(4):
    info = init_process_group(torch.device("cpu"))
    assert info.created and info.world_size == 4
    if parallel_state is not None:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2,
                                                 pipeline_model_parallel_size=2)
        groups = [parallel_state.get_tensor_model_parallel_group(),
                  parallel_state.get_pipeline_model_parallel_group()]
    else:
        rank = dist.get_rank()
        pairs = [[0, 1], [2, 3], [0, 2], [1, 3]]
        made = [dist.new_group(pair) for pair in pairs]
        groups = [g for g, pair in zip(made, pairs) if rank in pair]
    for group in groups:
        value = torch.ones(1)
        dist.all_reduce(value, group=group)
        assert value.item() == 2, value
    value = torch.ones(1)
    dist.all_reduce(value)
    assert value.item() == 4, value
    if parallel_state is not None:
        parallel_state.destroy_model_parallel()
    dist.barrier()
    dist.destroy_process_group()
print("groups ok", flush=True)
"""


@pytest.mark.slow
@pytest.mark.distributed
def test_default_group_created_again_under_torchrun(tmp_path: Path) -> None:
    """Each new group rendezvouses under fresh keys: without that, a process could read the
    address a peer published for the previous group and fail with "Connection refused"."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "4", str(script)], capture_output=True, text=True, env=env, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert proc.stdout.count("groups ok") == 4, output[-3000:]
