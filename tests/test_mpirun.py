"""examples/mpirun/train.sh (docs/multi-node.md): Open MPI's rank variables become torch's, and
the script runs ``python -m shardwise train`` with the user's flags. A stub stands in for python
(``PYTHON``): it prints what it was given, so nothing trains (milliseconds)."""

import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "mpirun" / "train.sh"
SHOWN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
         "OMP_NUM_THREADS")


@pytest.fixture
def stub(tmp_path):
    path = tmp_path / "python"
    path.write_text("#!/bin/sh\n" + "".join(f'echo "{k}=${k}"\n' for k in SHOWN)
                    + 'echo "ARGS=$*"\n')
    path.chmod(0o755)
    return path


def _run(stub, **ompi):
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(stub), **ompi}
    p = subprocess.run(["bash", str(SCRIPT), "--dp", "2", "--tp", "4", "--out", "runs/job"],
                       env=env, capture_output=True, text=True, timeout=30)
    seen = dict(line.split("=", 1) for line in p.stdout.splitlines() if "=" in line)
    return p, seen


def test_open_mpi_rank_variables_become_torchs(stub):
    p, seen = _run(stub, OMPI_COMM_WORLD_RANK="5", OMPI_COMM_WORLD_SIZE="8",
                   OMPI_COMM_WORLD_LOCAL_RANK="1", OMPI_COMM_WORLD_LOCAL_SIZE="4",
                   MASTER_ADDR="node0", MASTER_PORT="29511")
    assert p.returncode == 0, p.stderr
    assert {k: seen[k] for k in SHOWN} == {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "node0", "MASTER_PORT": "29511", "OMP_NUM_THREADS": "1"}
    assert seen["ARGS"] == "-m shardwise train --dp 2 --tp 4 --out runs/job"


def test_one_node_defaults_the_address_and_several_nodes_need_it(stub):
    p, seen = _run(stub, OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="2",
                   OMPI_COMM_WORLD_LOCAL_RANK="0", OMPI_COMM_WORLD_LOCAL_SIZE="2")
    assert p.returncode == 0, p.stderr
    assert (seen["MASTER_ADDR"], seen["MASTER_PORT"]) == ("127.0.0.1", "29500")
    p, seen = _run(stub, OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="8",
                   OMPI_COMM_WORLD_LOCAL_RANK="0", OMPI_COMM_WORLD_LOCAL_SIZE="4")
    assert p.returncode == 2 and not seen, p.stdout
    assert "MASTER_ADDR is not set" in p.stderr and "-x MASTER_ADDR=" in p.stderr


def test_outside_mpirun_it_says_how_to_start_it(stub):
    p, seen = _run(stub)
    assert p.returncode == 2 and not seen
    assert "start it with Open MPI's mpirun" in p.stderr
