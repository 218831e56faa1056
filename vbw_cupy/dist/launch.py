"""One process a GPU on one host: the launcher, and the rendezvous that gives every process its NCCL rank.

    python -m vbw_cupy.dist.launch --nproc 2 my_script.py [args...]

starts `nproc` copies of `python my_script.py args...`, each with VBW_RANK, VBW_WORLD_SIZE and VBW_RDZV (a
fresh folder) in its environment, and waits for them. In the script, `NcclComm.from_env()` makes the process's
communicator on GPU VBW_RANK % (visible GPUs): rank 0 writes NCCL's unique id into the folder, the others read
it. Every rank then runs the same program on its own data (SPMD); a tensor-parallel model is one
`TPLlamaGPU(config, weights, comm, ...)` a process, and `models.generate_ids` on it gives every rank the same
ids (the same logits, sampled the same way).

If a process exits with an error the launcher stops the others (SIGTERM, then SIGKILL after a grace period)
and exits with that process's status; Ctrl-C stops them all. Under `mpiexec`, use `NcclComm.from_mpi()`
instead: the same program, and several hosts.

Threads (`TPGroup.on_gpus`, `NcclComm.init_all`) are the other way: one process, one thread a GPU, one Python
interpreter whose GIL the ranks share.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ENV_RANK, ENV_SIZE, ENV_RDZV = "VBW_RANK", "VBW_WORLD_SIZE", "VBW_RDZV"
_ID_FILE = "nccl_unique_id"


def env_rank() -> tuple[int, int, pathlib.Path]:
    """(rank, world size, rendezvous folder) from the launcher's environment; RuntimeError outside it."""
    try:
        rank, size, rdzv = int(os.environ[ENV_RANK]), int(os.environ[ENV_SIZE]), pathlib.Path(os.environ[ENV_RDZV])
    except (KeyError, ValueError) as e:
        raise RuntimeError(f"not started by the launcher: {ENV_RANK}, {ENV_SIZE} and {ENV_RDZV} must be set "
                           "(python -m vbw_cupy.dist.launch --nproc N script.py)") from e
    if not 0 <= rank < size:
        raise RuntimeError(f"{ENV_RANK} = {rank} outside [0, {ENV_SIZE} = {size})")
    return rank, size, rdzv


def rendezvous(folder, rank: int, make_id, timeout: float = 120.0) -> bytes:
    """The bytes rank 0 makes with make_id(), on every rank: rank 0 writes them into `folder` (atomically: a
    temporary name, then a rename), the others wait for the file. TimeoutError after `timeout` seconds."""
    path = pathlib.Path(folder) / _ID_FILE
    if rank == 0:
        data = bytes(make_id())
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        return data
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: rank 0 wrote no NCCL id into {folder} in {timeout} s")
        time.sleep(0.01)
    return path.read_bytes()


def _stop(procs, grace: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def launch(argv: list, nproc: int, grace: float = 5.0, python: str | None = None) -> int:
    """Run `python argv...` in `nproc` processes (see the module docstring); returns the exit status: 0 when
    every process succeeded, else the first failure's (128 + signal for a process killed by one)."""
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc: expected a positive int, got {nproc!r}")
    if not argv:
        raise ValueError("argv: expected a script (and its arguments), got nothing")
    rdzv = tempfile.mkdtemp(prefix="vbw_rdzv_")
    procs = []
    try:
        for r in range(nproc):
            env = dict(os.environ, **{ENV_RANK: str(r), ENV_SIZE: str(nproc), ENV_RDZV: rdzv})
            procs.append(subprocess.Popen([python or sys.executable, *argv], env=env))
        status = 0
        while status == 0 and any(p.poll() is None for p in procs):
            for p in procs:
                rc = p.poll()
                if rc:
                    status = rc if rc > 0 else 128 - rc
                    break
            time.sleep(0.05)
        if status == 0:
            rc = next((p.returncode for p in procs if p.returncode), 0)
            status = rc if rc >= 0 else 128 - rc
        return status
    except KeyboardInterrupt:
        return 130
    finally:
        _stop(procs, grace)
        shutil.rmtree(rdzv, ignore_errors=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m vbw_cupy.dist.launch",
                                description="Run a script in N processes, one GPU each (NcclComm.from_env()).")
    p.add_argument("--nproc", type=int, required=True, help="processes (ranks), one a GPU")
    p.add_argument("--grace", type=float, default=5.0, help="seconds a stopped rank gets before SIGKILL")
    p.add_argument("script", help="the Python script every rank runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    a = p.parse_args(argv)
    if a.nproc < 1:
        p.error(f"--nproc: expected a positive int, got {a.nproc}")
    return launch([a.script, *a.args], a.nproc, a.grace)


if __name__ == "__main__":
    sys.exit(main())
