"""Communicators: what a rank of a tensor-parallel model or of ring attention needs from the others.

`Comm` is the interface: `rank`, `size`, `all_reduce` (a sum, in place), and `sendrecv` (send one array to a
peer while receiving one from another, the step of a ring). Two implementations:

- `SimComm`: N ranks simulated in one process on NumPy arrays, one thread a rank (`SimGroup.run`). Collectives
  meet at a barrier, so the ranks run in lockstep like real ones; the sum is taken in rank order, so every rank
  gets the same bits. This is what the CPU tests and `vbw-cupy generate --tp N --device cpu` run on.
- `NcclComm`: NCCL through `cupy.cuda.nccl` (imported on first use): all-reduce on the current stream, the
  ring exchange on a side stream so it overlaps the compute on the block in hand. Ranks are one process each
  (`NcclComm.from_env` under the project's launcher, `python -m vbw_cupy.dist.launch`; `from_mpi` under
  mpiexec; `from_unique_id` for any other launcher) or one thread a GPU in one process (`NcclComm.init_all`
  then `RankThreads` / `run_ranks`).
"""
from __future__ import annotations

import queue
import threading

import numpy as np


class Comm:
    """One rank's view of a group of `size` ranks.

    all_reduce(x): x summed over the ranks, written into x (every rank passes an array of the same shape and
    dtype); returns x. sendrecv(x, dst, out, src): sends x to rank dst and receives rank src's array into `out`
    (same dtype, its shape agreed by the two ranks) without waiting; returns a `Pending` whose wait() gives
    `out` once it may be used. x must not be written before that wait.
    """
    rank: int
    size: int

    def all_reduce(self, x):
        raise NotImplementedError

    def sendrecv(self, x, dst: int, out, src: int) -> "Pending":
        raise NotImplementedError

    def activate(self) -> None:
        """Make this rank's device current in the calling thread (nothing to do on the host)."""

    @property
    def next(self) -> int:
        return (self.rank + 1) % self.size

    @property
    def prev(self) -> int:
        return (self.rank - 1) % self.size


class Pending:
    """An exchange in flight: wait() returns the received array once it may be used."""

    def __init__(self, wait):
        self._wait = wait

    def wait(self):
        return self._wait()


# ---------------------------------------------------------------------------------------------- simulated
class SimGroup:
    """N simulated ranks in one process. `comms[r]` is rank r's `SimComm`; `run(fn, ...)` calls fn(comm, ...)
    on every rank, one thread each, and returns the results in rank order.

    >>> SimGroup(2).run(lambda comm: comm.all_reduce(np.full(3, comm.rank + 1.0)))   # doctest: +SKIP
    [array([3., 3., 3.]), array([3., 3., 3.])]
    """

    def __init__(self, size: int, timeout: float = 120.0):
        if not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"size: expected a positive int, got {size!r}")
        self.size, self.timeout = int(size), timeout
        self._barrier = threading.Barrier(self.size, timeout=timeout)
        self._slots = [None] * self.size
        self._mail = {(s, d): queue.SimpleQueue() for s in range(self.size) for d in range(self.size)}
        self._broken = threading.Event()
        self.comms = [SimComm(self, r) for r in range(self.size)]

    def run(self, fn, *args, **kwargs) -> list:
        try:
            return run_ranks(fn, self.comms, *args, on_error=self._abort, **kwargs)
        finally:
            self._recover()

    def _abort(self):
        """A rank failed: wake the others (waiting at the barrier or for a message) with BrokenBarrierError."""
        self._broken.set()
        self._barrier.abort()

    def _recover(self):
        """After a run in which a rank failed (every rank has returned): the barrier, the mailboxes and the slots
        as new, so the group stays usable (it stayed broken: every later collective raised)."""
        if self._broken.is_set():
            self._barrier.reset()
            for box in self._mail.values():
                while not box.empty():
                    box.get_nowait()
            self._slots = [None] * self.size
            self._broken.clear()


class SimComm(Comm):
    """Rank `rank` of a `SimGroup` (NumPy arrays)."""

    def __init__(self, group: SimGroup, rank: int):
        self.group, self.rank, self.size = group, rank, group.size

    def all_reduce(self, x):
        g = self.group
        g._slots[self.rank] = x
        g._barrier.wait()
        total = g._slots[0].copy()
        for other in g._slots[1:]:   # rank order on every rank: the same bits everywhere
            total += other
        g._barrier.wait()            # everyone has read the slots before anyone writes into its x
        x[...] = total
        return x

    def sendrecv(self, x, dst: int, out, src: int) -> Pending:
        g = self.group
        g._mail[(self.rank, dst)].put(np.array(x, copy=True))

        def wait():
            box, waited = g._mail[(src, self.rank)], 0.0
            while True:
                try:
                    got = box.get(timeout=0.05)
                    break
                except queue.Empty:
                    waited += 0.05
                if g._broken.is_set():
                    raise threading.BrokenBarrierError(f"rank {self.rank}: another rank failed")
                if waited >= g.timeout:
                    raise TimeoutError(f"rank {self.rank}: nothing from rank {src} in {g.timeout} s")
            if got.shape != out.shape or got.dtype != out.dtype:
                raise ValueError(f"rank {self.rank}: expected {out.shape} {out.dtype} from rank {src}, "
                                 f"got {got.shape} {got.dtype}")
            out[...] = got
            return out
        return Pending(wait)


def _abort_all(comms):
    """The default on_error of `run_ranks` / `RankThreads`: where every comm can abort (NcclComm), abort them
    all, so a rank blocked in a collective on a peer that failed is released instead of hanging; None
    otherwise."""
    if comms and all(callable(getattr(c, "abort", None)) for c in comms):
        def abort():
            first = None
            for c in comms:   # every comm, even when one abort fails: a comm left live can hang its rank
                try:
                    c.abort()
                except Exception as e:  # noqa: BLE001 - raised after the others are aborted
                    first = first or e
            if first is not None:
                raise first
        return abort
    return None


def run_ranks(fn, comms, *args, on_error=None, **kwargs) -> list:
    """fn(comm, *args, **kwargs) for every comm of `comms`, one thread each (the comm's device made current);
    the results in rank order. At the first exception on_error() runs once (it should unblock the other ranks,
    as aborting a barrier does); that exception is raised again here once every thread has ended. Without
    on_error, comms that can abort (NcclComm) are aborted: they are unusable after, and no rank hangs."""
    comms = list(comms)
    if on_error is None:
        on_error = _abort_all(comms)
    results, errors, lock = [None] * len(comms), [], threading.Lock()

    def body(i, comm):
        try:
            comm.activate()
            results[i] = fn(comm, *args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            with lock:
                errors.append((i, e))
                first = len(errors) == 1
            if first and on_error is not None:   # once, at the first error
                try:
                    on_error()
                except BaseException as e2:  # noqa: BLE001 - reported after the rank's own error
                    with lock:
                        errors.append((i, e2))

    threads = [threading.Thread(target=body, args=(i, c), name=f"rank{i}", daemon=True) for i, c in enumerate(comms)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        # a rank that failed first explains more than the ranks whose barrier it broke
        errors.sort(key=lambda ie: isinstance(ie[1], threading.BrokenBarrierError))
        raise errors[0][1]
    return results


class RankThreads:
    """`run_ranks` on long-lived threads, one a comm (its device made current once): calling it with fn runs
    fn(comm) on every rank and returns the results in rank order, raising the first exception. A model's
    decode step goes through this every token, where starting threads each call would cost more than the
    step's host work. close() (or dropping the object) ends the threads.

    on_error(), when given, runs once at the first rank error (NCCL groups abort their communicators there, so
    a rank blocked on a peer that failed is released instead of hanging) and the object is broken after it:
    every later call raises. Without it, comms that can abort (NcclComm) are aborted that way; other comms'
    threads stay usable after a rank error (a simulated group's)."""

    def __init__(self, comms, on_error=None):
        self.comms = list(comms)
        on_error = on_error if on_error is not None else _abort_all(self.comms)
        self._jobs = [queue.SimpleQueue() for _ in self.comms]
        self._done = queue.SimpleQueue()
        self._lock = threading.Lock()   # one call at a time: the ranks' queues stay in step
        self._seq = 0
        self._on_error = on_error
        self.closed, self.broken = False, None
        self.threads = [threading.Thread(target=self._loop, args=(self.comms[i], self._jobs[i], self._done, i),
                                         name=f"rank{i}", daemon=True) for i in range(len(self.comms))]
        for t in self.threads:
            t.start()

    @staticmethod
    def _loop(comm, jobs, done, i):   # holds no reference to the RankThreads, so dropping it ends the thread
        comm.activate()
        while (job := jobs.get()) is not None:
            seq, fn = job
            job = None   # the closure (and what it holds, a model say) is not kept alive by an idle thread
            try:
                res, err = fn(comm), None
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                res, err = None, e
            fn = None
            done.put((seq, i, err, res))
            res = err = None

    def __call__(self, fn) -> list:
        if self.closed:
            raise RuntimeError("the rank threads were closed (TPGroup.close)")
        if self.broken is not None:
            raise RuntimeError("the ranks stopped at an earlier rank error") from self.broken
        if threading.current_thread() in self.threads:
            raise RuntimeError("a rank thread cannot call its own group")
        with self._lock:
            self._seq += 1
            seq = self._seq
            for q in self._jobs:
                q.put((seq, fn))
            results, errors, got = [None] * len(self.comms), [], 0
            while got < len(self.comms):
                s, i, err, res = self._done.get()
                if s != seq:   # left over from a call interrupted on the host (KeyboardInterrupt): dropped
                    continue
                got += 1
                results[i] = res
                if err is not None:
                    errors.append(err)
                    if self._on_error is not None and self.broken is None:
                        self.broken = err
                        try:
                            self._on_error()
                        except Exception:  # noqa: BLE001 - the rank's error is the one to raise
                            pass
        if errors:
            raise errors[0]
        return results

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            for q in self._jobs:
                q.put(None)

    def __del__(self):
        if getattr(self, "closed", True) is False:   # (nothing to end if __init__ failed before its threads)
            self.close()


# ---------------------------------------------------------------------------------------------- NCCL
def _nccl():
    try:
        from cupy.cuda import nccl
    except ImportError as e:
        raise RuntimeError("NCCL: cupy.cuda.nccl is not available (install CuPy for your CUDA and NCCL: "
                           "pip install vbw_cupy[cuda12] nvidia-nccl-cu12)") from e
    if not getattr(nccl, "available", True):
        raise RuntimeError("NCCL: CuPy was built without NCCL (pip install nvidia-nccl-cu12)")
    return nccl


def _visible_gpus() -> int:
    import cupy
    return cupy.cuda.runtime.getDeviceCount()


def _nccl_dtype(nccl, dtype) -> int:
    dtype = np.dtype(dtype)
    table = {"float16": nccl.NCCL_FLOAT16, "float32": nccl.NCCL_FLOAT32, "float64": nccl.NCCL_FLOAT64,
             "bfloat16": getattr(nccl, "NCCL_BFLOAT16", 9), "int32": nccl.NCCL_INT32, "int64": nccl.NCCL_INT64}
    if dtype.name not in table:
        raise TypeError(f"x: NCCL has no sum for dtype {dtype}")
    return table[dtype.name]


class NcclComm(Comm):
    """Rank `rank` of `size` over NCCL, on CUDA device `device` (CuPy arrays on that device).

    all_reduce runs on the current stream (so a CUDA graph captures it); sendrecv runs on this rank's side
    stream after the work already queued on the current stream, and its Pending.wait() makes the current
    stream wait for it, so the compute queued in between overlaps the transfer.
    """

    def __init__(self, communicator, rank: int, size: int, device: int):
        import cupy
        self._nccl, self._comm = _nccl(), communicator
        self.rank, self.size, self.device = rank, size, device
        with cupy.cuda.Device(device):
            self._stream = cupy.cuda.Stream(non_blocking=True)

    @classmethod
    def from_unique_id(cls, uid, rank: int, size: int, device: int | None = None) -> "NcclComm":
        """One rank of a group of processes; `uid` is rank 0's `nccl.get_unique_id()`, handed to every process.
        device defaults to rank % (visible GPUs)."""
        import cupy
        nccl = _nccl()
        device = rank % cupy.cuda.runtime.getDeviceCount() if device is None else device
        with cupy.cuda.Device(device):
            return cls(nccl.NcclCommunicator(size, tuple(uid), rank), rank, size, device)

    @classmethod
    def from_env(cls, timeout: float = 120.0) -> "NcclComm":
        """This process's rank when started by `python -m vbw_cupy.dist.launch --nproc N script.py` (one process
        a GPU on this host): rank and size from the environment, NCCL's unique id from rank 0 through the
        launcher's rendezvous folder, the GPU rank % (visible GPUs), made the current device."""
        from .launch import env_rank, rendezvous
        rank, size, folder = env_rank()
        nccl = _nccl()
        have = _visible_gpus()
        if size > have:
            raise RuntimeError(f"{size} ranks on {have} visible GPUs: the launcher runs one process a GPU "
                               f"(--nproc at most {have})")
        raw = rendezvous(folder, rank, lambda: (np.asarray(nccl.get_unique_id(), dtype=np.int64) & 0xFF)
                         .astype(np.uint8).tobytes(), timeout)
        if len(raw) != 128:
            raise RuntimeError(f"rank {rank}: NCCL id of {len(raw)} bytes in {folder} (expected 128)")
        comm = cls.from_unique_id(tuple(np.frombuffer(raw, dtype=np.int8).tolist()), rank, size)
        comm.activate()   # the process's one GPU is its current device from here on
        return comm

    @classmethod
    def from_mpi(cls, mpi_comm=None) -> "NcclComm":
        """Under mpiexec: rank and size from MPI (mpi4py), the unique id broadcast from rank 0."""
        from mpi4py import MPI
        mpi_comm = mpi_comm or MPI.COMM_WORLD
        rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        uid = mpi_comm.bcast(_nccl().get_unique_id() if rank == 0 else None, root=0)
        return cls.from_unique_id(uid, rank, size)

    @classmethod
    def init_all(cls, devices) -> list:
        """One communicator per device of `devices` (ints) in this process; drive them with `run_ranks`."""
        nccl = _nccl()
        devices = list(devices)
        return [cls(c, r, len(devices), d) for r, (c, d) in enumerate(zip(nccl.NcclCommunicator.initAll(devices),
                                                                          devices))]

    def activate(self) -> None:
        import cupy
        cupy.cuda.Device(self.device).use()

    def all_reduce(self, x):
        import cupy
        if not x.flags.c_contiguous:
            raise ValueError("x: expected a C-contiguous array")
        self._live().allReduce(x.data.ptr, x.data.ptr, x.size, _nccl_dtype(self._nccl, x.dtype),
                               self._nccl.NCCL_SUM, cupy.cuda.get_current_stream().ptr)
        return x

    def _live(self):
        if self._comm is None:
            raise RuntimeError(f"rank {self.rank}: the NCCL communicator was closed or aborted")
        return self._comm

    def abort(self) -> None:
        """Abort the NCCL communicator: its pending work stops (a rank waiting for a failed peer is released);
        the comm is unusable after. Safe from any thread."""
        if self._comm is not None:
            comm, self._comm = self._comm, None
            comm.abort()

    def close(self) -> None:
        """Destroy the NCCL communicator (after the work queued on this device); the comm is unusable after."""
        import cupy
        if self._comm is not None:
            with cupy.cuda.Device(self.device):
                cupy.cuda.Device().synchronize()
                self._comm.destroy()
            self._comm = None

    def sendrecv(self, x, dst: int, out, src: int) -> Pending:
        import cupy
        for name, a in (("x", x), ("out", out)):
            if not a.flags.c_contiguous:
                raise ValueError(f"{name}: expected a C-contiguous array")
        nccl, side = self._nccl, self._stream
        side.wait_event(cupy.cuda.get_current_stream().record())   # x is written, out free to overwrite
        comm = self._live()
        nccl.groupStart()   # both in one group: a ring of blocking sends would deadlock
        comm.send(x.data.ptr, x.nbytes, nccl.NCCL_UINT8, dst, side.ptr)
        comm.recv(out.data.ptr, out.nbytes, nccl.NCCL_UINT8, src, side.ptr)
        nccl.groupEnd()
        done = side.record()

        def wait():
            cupy.cuda.get_current_stream().wait_event(done)
            return out
        return Pending(wait)
