"""The pool a sweep or a batch of renders runs on, and the loop that drives it.

`open_pool` picks, in this order:

* `scheduler="tcp://host:8786"`: the workers of an existing Dask scheduler (started by `dask scheduler`
  and `dask worker` / `dask cuda worker` on each host, or by dask-jobqueue on Slurm/PBS). The address is
  tried first with a plain TCP connection, so an unreachable one is a single line within seconds.
* `workers=1`: this process, one task after another, no Dask at all (the plain sequential path).
* a host with CUDA GPUs: one worker process per GPU, each seeing only its own GPU: dask-cuda's
  `LocalCUDACluster` where dask-cuda is installed, else a cluster whose workers are pinned by
  `CUDA_VISIBLE_DEVICES` (also used for `gpus_per_task` > 1: a worker per group of GPUs).
* otherwise a `LocalCluster` of single-threaded worker processes (half the cores by default).

A local worker gets the host's cores divided among the workers as its OpenMP/MKL threads (Dask's own
default is one), memory without a Dask limit (an engine is meant to stay), and may start processes of
its own (a papermill kernel, an encoder). Each task asks for `gpus_per_task` of the "GPU" resource where
the workers declare one, so two tasks never share a GPU.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from lab.errors import InputError

DEFAULT_PORT = 8786


@dataclass
class Pool:
    """Where tasks run: `client` None is this process (sequential)."""

    kind: str                                # in words, for the log and the records
    workers: int
    client: Any = None
    cluster: Any = None
    resources: dict[str, float] | None = None   # what each task asks of a worker ("GPU": n)

    def close(self) -> None:
        for thing in (self.client, self.cluster):
            if thing is not None:
                try:
                    thing.close()
                except Exception:   # a worker already gone: nothing left to close
                    pass
        self.client = self.cluster = None

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def gpu_ids() -> list[str]:
    """The CUDA devices this process may use, as CUDA_VISIBLE_DEVICES names them ("0", "1", … or UUIDs)."""
    try:
        import torch

        n = torch.cuda.device_count()
    except Exception:   # no torch, or a driver that cannot answer: no GPU to spread over
        return []
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return (visible or [str(i) for i in range(n)])[:n]


def scheduler_address(address: str, timeout: float = 5.0) -> str:
    """`address` as Dask takes it, after a plain TCP connection to it succeeded within `timeout` seconds;
    InputError (one line: the address, why, what to do) where nothing answers."""
    text = address if "://" in address else f"tcp://{address}"
    proto, rest = text.split("://", 1)
    if proto not in ("tcp", "tls"):
        return text   # another transport (ucx, inproc): the client's own error says what went wrong
    host, _, port = rest.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit():
        raise InputError(f"--scheduler {address}: expected tcp://HOST:PORT (a `dask scheduler` prints its address; "
                         f"its default port is {DEFAULT_PORT})")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except socket.gaierror:
        raise InputError(f"--scheduler {address}: unknown host {host!r} (check the name, or leave out --scheduler "
                         "for a local cluster)") from None
    except OSError as e:
        why = "no answer within %g s" % timeout if isinstance(e, socket.timeout) else (e.strerror or str(e)).lower()
        raise InputError(f"--scheduler {address}: no Dask scheduler answers there ({why}); start one with "
                         f"`dask scheduler` on that host, or leave out --scheduler for a local cluster") from None
    return text


def _thread_config(workers: int) -> dict[str, Any]:
    """Dask settings for local workers: the cores shared out as OpenMP/MKL threads, processes of their own."""
    import dask
    import distributed  # noqa: F401 - its defaults must be in dask's config before `dask.config.set` notes what to restore

    t = str(max(1, (os.cpu_count() or 1) // max(1, workers)))
    env = dict(dask.config.get("distributed.nanny.pre-spawn-environ", {}) or {})
    env.update(OMP_NUM_THREADS=t, MKL_NUM_THREADS=t, OPENBLAS_NUM_THREADS=t)
    return {"distributed.nanny.pre-spawn-environ": env, "distributed.worker.daemon": False}


def pinned_cluster(groups: list[list[str]]) -> Any:
    """A local cluster with one worker per group of GPUs, each seeing only its group (CUDA_VISIBLE_DEVICES)
    and declaring that many of the "GPU" resource."""
    from distributed import Nanny, Scheduler, SpecCluster

    spec = {f"gpu{'+'.join(g)}": {"cls": Nanny, "options": {
        "nthreads": 1, "memory_limit": 0, "resources": {"GPU": len(g)},
        "env": {"CUDA_VISIBLE_DEVICES": ",".join(g)}}} for g in groups}
    return SpecCluster(workers=spec, scheduler={"cls": Scheduler, "options": {"dashboard_address": None}},
                       silence_logs=logging.ERROR, name="lab-pinned-gpus")


def _gpu_cluster(gpus: list[str], workers: int | None, gpus_per_task: int, log: Callable[[str], Any]) -> tuple[Any, str]:
    groups = [gpus[i:i + gpus_per_task] for i in range(0, len(gpus) - gpus_per_task + 1, gpus_per_task)]
    if not groups:
        raise InputError(f"--gpus-per-task {gpus_per_task}: this host has {len(gpus)} GPU(s)")
    if workers is not None and workers < len(groups):
        groups = groups[:workers]
    elif workers is not None and workers > len(groups):
        log(f"--workers {workers}: this host has {len(gpus)} GPU(s), so {len(groups)} worker(s), one per "
            f"{'GPU' if gpus_per_task == 1 else f'{gpus_per_task} GPUs'}")
    if gpus_per_task == 1:
        try:
            from dask_cuda import LocalCUDACluster

            c = LocalCUDACluster(CUDA_VISIBLE_DEVICES=[g[0] for g in groups], n_workers=len(groups),
                                 threads_per_worker=1, memory_limit=0, dashboard_address=None,
                                 resources={"GPU": 1}, silence_logs=logging.ERROR)
            return c, f"dask-cuda LocalCUDACluster, {len(groups)} worker(s), one GPU each"
        except ImportError:
            log("dask-cuda is not installed: one worker per GPU, pinned by CUDA_VISIBLE_DEVICES")
        except Exception as e:   # dask-cuda present but unable to start here: the plain pinned workers still can
            log(f"dask-cuda's LocalCUDACluster did not start ({type(e).__name__}: {e}); one worker per GPU, "
                "pinned by CUDA_VISIBLE_DEVICES")
    return pinned_cluster(groups), f"local cluster, {len(groups)} worker(s) pinned to GPU(s) " + \
        ", ".join("+".join(g) for g in groups)


def _remote(address: str, gpus_per_task: int, log: Callable[[str], Any]) -> Pool:
    from distributed import Client

    text = scheduler_address(address)
    try:
        client = Client(text, timeout="10s")
    except (OSError, TimeoutError) as e:
        raise InputError(f"--scheduler {address}: something answers there but no Dask scheduler ({e})") from None
    try:
        client.wait_for_workers(1, timeout=60)
    except TimeoutError:
        client.close()
        raise InputError(f"--scheduler {address}: no worker joined within 60 s (start `dask worker {text}` or "
                         f"`dask cuda worker {text}` on each host)") from None
    info = client.scheduler_info(n_workers=-1)["workers"] if _takes_n_workers(client) else client.scheduler_info()["workers"]
    with_gpu = [w for w in info.values() if (w.get("resources") or {}).get("GPU")]
    resources = {"GPU": gpus_per_task} if with_gpu and len(with_gpu) == len(info) else None
    if resources is None and gpus_per_task > 1:
        log(f"--gpus-per-task {gpus_per_task}: the workers declare no GPU resource (start them with "
            "--resources GPU=N); each task takes one worker thread")
    return Pool(f"scheduler {text}, {len(info)} worker(s)", len(info), client, None, resources)


def _takes_n_workers(client: Any) -> bool:
    import inspect

    return "n_workers" in inspect.signature(client.scheduler_info).parameters


def open_pool(workers: int | None = None, scheduler: str | None = None, gpus_per_task: int = 1,
              tasks: int | None = None, log: Callable[[str], Any] = print) -> Pool:
    """The pool `tasks` tasks run on (see the module's docstring for which one)."""
    if workers is not None and workers < 1:
        raise InputError(f"--workers {workers}: expected at least 1")
    if gpus_per_task < 1:
        raise InputError(f"--gpus-per-task {gpus_per_task}: expected at least 1")
    if scheduler:
        if workers is not None:
            raise InputError("--workers and --scheduler: give one (a scheduler's workers are started on their hosts)")
        return _remote(scheduler, gpus_per_task, log)
    if workers == 1:
        return Pool("this process, one task after another", 1)
    import dask

    gpus = gpu_ids()
    if gpus:
        n = len(gpus) // gpus_per_task
        with dask.config.set(_thread_config(min(n, workers or n))):
            cluster, kind = _gpu_cluster(gpus, workers, gpus_per_task, log)
        resources = {"GPU": gpus_per_task} if gpus_per_task > 1 else {"GPU": 1}
    else:
        if gpus_per_task > 1:
            raise InputError(f"--gpus-per-task {gpus_per_task}: no CUDA GPU is visible on this host")
        n = workers or max(1, min(tasks or 2, (os.cpu_count() or 2) // 2))
        if n == 1:
            return Pool("this process, one task after another", 1)
        from distributed import LocalCluster

        with dask.config.set(_thread_config(n)):
            cluster = LocalCluster(n_workers=n, threads_per_worker=1, processes=True, memory_limit=0,
                                   dashboard_address=None, silence_logs=logging.ERROR)
        kind, resources = f"local cluster, {n} worker process(es) on the CPU", None
    from distributed import Client

    client = Client(cluster)
    return Pool(kind, len(cluster.workers), client, cluster, resources)


def where() -> dict[str, Any]:
    """The worker running this task (its name, or "local"), its host, and the GPU it sees (CUDA_VISIBLE_DEVICES'
    first entry and, where NVML answers, the GPU's name)."""
    try:
        from distributed import get_worker

        w = get_worker()
        name = str(w.name) if w.name is not None else w.address
    except (ImportError, ValueError):
        name = "local"
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip() or None
    gpu_name = None
    if gpu is not None:
        try:
            from distributed.diagnostics import nvml

            gpu_name = nvml.one_time().get("name")
        except Exception:   # no NVML here: the device number alone
            pass
    return {"worker": name, "host": socket.gethostname(), "gpu": gpu, "gpu_name": gpu_name}


class Stop(Exception):
    """Raised by a `done` callback when the rest cannot succeed: what has not finished is cancelled, and the
    caller marks it (run_all re-raises this)."""


def run_all(pool: Pool, tasks: list[tuple[str, Callable[..., Any], tuple]],
            done: Callable[[str, Any, BaseException | None], None], desc: str, unit: str) -> None:
    """Run each (key, fn, args) on the pool; `done(key, result, error)` as each finishes, in the order they
    finish, with a progress bar. Ctrl-C (or SIGTERM) cancels what has not finished and raises
    KeyboardInterrupt; the caller marks those tasks."""
    from lab.progress import tqdm

    old = None
    if threading.current_thread() is threading.main_thread():
        def on_term(signum: int, frame: Any) -> None:
            raise KeyboardInterrupt(f"signal {signum}")
        old = signal.signal(signal.SIGTERM, on_term)
    bar = tqdm(total=len(tasks), desc=desc, unit=unit)
    try:
        if pool.client is None:
            for key, fn, args in tasks:
                try:
                    result, err = fn(*args), None
                except Exception as e:   # a task's own failure: recorded, the others run
                    result, err = None, e
                done(key, result, err)
                bar.update()
        else:
            _run_futures(pool, tasks, done, bar)
    finally:
        bar.close()
        if old is not None:
            signal.signal(signal.SIGTERM, old)


def _run_futures(pool: Pool, tasks: list[tuple[str, Callable[..., Any], tuple]],
                 done: Callable[[str, Any, BaseException | None], None], bar: Any) -> None:
    from distributed import as_completed

    tag = uuid.uuid4().hex[:8]
    futures = {pool.client.submit(fn, *args, key=f"lab-{key}-{tag}", pure=False, resources=pool.resources): key
               for key, fn, args in tasks}
    try:
        for f in as_completed(list(futures)):
            try:
                result, err = f.result(), None
            except Exception as e:   # the worker died or the task raised: recorded, the others finish
                result, err = None, e
            done(futures[f], result, err)
            bar.update()
    except (KeyboardInterrupt, Stop):
        pool.client.cancel(list(futures), force=True)
        raise
