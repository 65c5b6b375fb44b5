#!/bin/bash
# shardwise under Open MPI's mpirun (no torchrun): mpirun starts one process per rank and sets
# Open MPI's variables; torch.distributed (and shardwise) read torchrun's. This maps one onto the
# other and runs `python -m shardwise train "$@"` as that rank. Launch it on every rank:
#
#   mpirun -np 8 -H node0:4,node1:4 -x MASTER_ADDR=node0 -x MASTER_PORT=29500 \
#       examples/mpirun/train.sh --dp 2 --tp 4 --out /shared/runs/job42
#
#   OMPI_COMM_WORLD_RANK        -> RANK              this rank, 0 … size-1
#   OMPI_COMM_WORLD_SIZE        -> WORLD_SIZE        every rank of the job
#   OMPI_COMM_WORLD_LOCAL_RANK  -> LOCAL_RANK        this rank on its node (its GPU with cuda)
#   OMPI_COMM_WORLD_LOCAL_SIZE  -> LOCAL_WORLD_SIZE  ranks on this node
#   MASTER_ADDR, MASTER_PORT    where rank 0 serves the process group's TCP store. Open MPI has no
#                               such variable: pass them with -x (the host of rank 0 and a free
#                               port); on one node MASTER_ADDR defaults to 127.0.0.1, and
#                               MASTER_PORT to 29500 everywhere.
#
# mpirun does not restart a lost rank: for that, and for the error file torchrun's summary
# prints, use torchrun (docs/multi-node.md). PYTHON picks the interpreter (default: python).
set -euo pipefail

if [ -z "${OMPI_COMM_WORLD_RANK:-}" ] || [ -z "${OMPI_COMM_WORLD_SIZE:-}" ]; then
    echo "examples/mpirun/train.sh: OMPI_COMM_WORLD_RANK/SIZE are not set: start it with" \
         "Open MPI's mpirun (mpirun -np N … examples/mpirun/train.sh [train flags])" >&2
    exit 2
fi
export RANK=$OMPI_COMM_WORLD_RANK
export WORLD_SIZE=$OMPI_COMM_WORLD_SIZE
export LOCAL_RANK=${OMPI_COMM_WORLD_LOCAL_RANK:-0}
export LOCAL_WORLD_SIZE=${OMPI_COMM_WORLD_LOCAL_SIZE:-1}
if [ -z "${MASTER_ADDR:-}" ]; then
    if [ "$LOCAL_WORLD_SIZE" != "$WORLD_SIZE" ]; then
        echo "examples/mpirun/train.sh: MASTER_ADDR is not set and the job spans several nodes:" \
             "pass rank 0's host, e.g. mpirun -x MASTER_ADDR=node0 -x MASTER_PORT=29500 …" >&2
        exit 2
    fi
    export MASTER_ADDR=127.0.0.1
fi
export MASTER_PORT=${MASTER_PORT:-29500}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}   # as torchrun sets when ranks share a node

exec "${PYTHON:-python}" -m shardwise train "$@"
