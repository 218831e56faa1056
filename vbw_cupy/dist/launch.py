"""One process a GPU on one host: the launcher, and the rendezvous that gives every process its NCCL rank.

    python -m vbw_cupy.dist.launch --nproc 2 my_script.py [args...]

starts `nproc` copies of `python my_script.py args...`, each with VBW_RANK, VBW_WORLD_SIZE and VBW_RDZV (a
fresh folder) in its environment, and waits for them. In the script, `NcclComm.from_env()` makes the process's
communicator on GPU VBW_RANK % (visible GPUs): rank 0 writes NCCL's unique id into the folder, the others read
it. Every rank then runs the same program on its own data (SPMD); a tensor-parallel model is one
`TPLlamaGPU(config, weights, comm, ...)` a process, and `models.generate_ids` on it gives every rank the same
ids (the same logits, sampled the same way).

If a process exits with an error the launcher stops the others (SIGTERM to each one's process group, then
SIGKILL after a grace period) and exits with that process's status; Ctrl-C, SIGTERM or SIGHUP to the launcher
stops them all. A rank that waits in NCCL for a peer that never comes (a program whose ranks disagree on their
collectives) waits forever, as under any launcher. Under `mpiexec`, use `NcclComm.from_mpi()` instead: the same
program, and several hosts.

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
import threading
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


_used = {}   # rendezvous folder -> how many ids this process has exchanged there


def rendezvous(folder, rank: int, make_id, timeout: float = 120.0) -> bytes:
    """The bytes rank 0 makes with make_id(), on every rank: rank 0 writes them into `folder` (atomically: a
    temporary name, then a rename), the others wait for the file. The n-th call in a process uses the n-th
    file, so every rank must make the same calls in the same order (an SPMD program does). TimeoutError after
    `timeout` seconds."""
    n = _used[str(folder)] = _used.get(str(folder), 0) + 1
    path = pathlib.Path(folder) / f"{_ID_FILE}.{n}"
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


def _signal_group(p, sig) -> None:
    try:
        os.killpg(p.pid, sig)   # the rank and what it started (each rank leads its own session)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(p) -> bool:
    try:
        os.killpg(p.pid, 0)   # (signal 0: is any process of the rank's group left?)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _stop(procs, grace: float, failed=()) -> None:
    """SIGTERM to the process groups of the ranks still running and of the ranks in `failed` (just reaped: a
    rank that failed may have left processes in its group; the group id of a rank reaped long before could
    belong to another process by now, so those are left alone), SIGKILL to those groups still alive after
    `grace` seconds. A second Ctrl-C or SIGTERM meanwhile is ignored: it used to stop the launcher here and
    leave the ranks running."""
    main = threading.current_thread() is threading.main_thread()
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)} \
        if main else {}
    procs = [p for i, p in enumerate(procs) if p.poll() is None or i in failed]
    try:
        for p in procs:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while any(_group_alive(p) for p in procs) and time.monotonic() < deadline:
            for p in procs:
                p.poll()   # (reaps a leader that exited: its group is then gone once its other members are)
            time.sleep(0.02)
        for p in procs:
            if _group_alive(p):
                _signal_group(p, signal.SIGKILL)
        for p in procs:
            p.wait()
    finally:
        for sig, h in saved.items():
            signal.signal(sig, h)


def _raise_exit(sig, frame):
    raise SystemExit(128 + sig)


def launch(argv: list, nproc: int, grace: float = 5.0, python: str | None = None) -> int:
    """Run `python argv...` in `nproc` processes (see the module docstring); returns the exit status: 0 when
    every process succeeded, else the first failure's (128 + signal for a process killed by one)."""
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc: expected a positive int, got {nproc!r}")
    if not argv:
        raise ValueError("argv: expected a script (and its arguments), got nothing")
    rdzv = tempfile.mkdtemp(prefix="vbw_rdzv_")
    procs, handlers, failed = [], {}, ()
    if threading.current_thread() is threading.main_thread():   # a SIGTERM / SIGHUP stops the ranks too
        for sig in (signal.SIGTERM, signal.SIGHUP):
            handlers[sig] = signal.signal(sig, _raise_exit)
    try:
        for r in range(nproc):
            env = dict(os.environ, **{ENV_RANK: str(r), ENV_SIZE: str(nproc), ENV_RDZV: rdzv})
            procs.append(subprocess.Popen([python or sys.executable, *argv], env=env, start_new_session=True))
        while True:
            exited = [(r, p.returncode) for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if exited:
                failed = {r for r, _ in exited}
                r, rc = exited[0]
                status = rc if rc > 0 else 128 - rc
                print(f"vbw_cupy.dist.launch: rank {r} exited with status {status}; stopping the others",
                      file=sys.stderr)
                return status
            if all(p.returncode == 0 for p in procs):
                return 0
            time.sleep(0.05)
    except KeyboardInterrupt:
        return 130
    except SystemExit as e:   # SIGTERM / SIGHUP
        return int(e.code)
    finally:
        try:
            _stop(procs, grace, failed)
        finally:
            shutil.rmtree(rdzv, ignore_errors=True)
            for sig, h in handlers.items():
                signal.signal(sig, h)


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
