"""Many processes on one machine: a small torchrun for JAX's multi-controller runtime.

:func:`launch` starts ``nproc`` copies of a command, each told by environment
variables who it is; each copy calls :func:`initialize_from_env` before touching
JAX, which gives it ``devices_per_process`` virtual CPU devices, gloo CPU
collectives and a ``jax.distributed`` connection to the coordinator on
127.0.0.1. Together they form one global mesh of ``nproc * devices_per_process``
devices — the same program then runs unchanged under a real cluster launcher.

On a cluster (SLURM, Kubernetes/GKE, Cloud TPU) do not use :func:`launch`:
call ``jax.distributed.initialize()`` with no arguments, which detects the
cluster environment, or :func:`initialize_from_env`, which falls back to exactly
that when the ``SPMDKIT_*`` variables are absent.

Failure handling: the launcher watches its children; when one exits with an
error (or is killed) it stops the others (SIGTERM, then SIGKILL after a grace
period) and reports which process failed, so nothing waits forever in a
collective. Children also get a bounded ``jax.distributed`` heartbeat timeout,
so a lost peer is detected even without the launcher.

Environment given to each process: ``SPMDKIT_COORDINATOR`` (host:port),
``SPMDKIT_NUM_PROCESSES``, ``SPMDKIT_PROCESS_ID``, ``SPMDKIT_LOCAL_DEVICES``,
``SPMDKIT_HEARTBEAT_S``, plus ``JAX_PLATFORMS=cpu`` and the XLA flag for the
device count.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import TextIO

from spmdkit.errors import SpmdError

__all__ = ["LaunchError", "child_env", "free_port", "initialize_from_env", "launch"]

ENV_COORDINATOR = "SPMDKIT_COORDINATOR"
ENV_NUM_PROCESSES = "SPMDKIT_NUM_PROCESSES"
ENV_PROCESS_ID = "SPMDKIT_PROCESS_ID"
ENV_LOCAL_DEVICES = "SPMDKIT_LOCAL_DEVICES"
ENV_HEARTBEAT = "SPMDKIT_HEARTBEAT_S"


class LaunchError(SpmdError, RuntimeError):
    """Processes could not be launched or initialised as asked.

    Broken example: ``launch(0, ["python", "train.py"])``.
    """


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def initialize_from_env(*, required: bool = False) -> bool:
    """Join the process group :func:`launch` set up, before any other JAX call.

    Reads the ``SPMDKIT_*`` variables; sets the virtual CPU device count, gloo CPU
    collectives, and calls ``jax.distributed.initialize`` with bounded heartbeat,
    initialisation and shutdown timeouts. Without those variables it does nothing
    (a single process) unless ``required=True``, in which case it calls
    ``jax.distributed.initialize()`` with cluster auto-detection.

    Args:
      required: fail (or auto-detect a cluster) when not launched by :func:`launch`.

    Returns:
      Whether ``jax.distributed`` was initialised.

    Example::

        >>> from spmdkit.runtime.launch import initialize_from_env
        >>> initialize_from_env()          # first thing in the child script
        >>> jax.device_count()             # nproc * devices_per_process
    """
    import jax

    coordinator = os.environ.get(ENV_COORDINATOR)
    if coordinator is None:
        if required:
            jax.distributed.initialize()
            return True
        return False
    try:
        nproc = int(os.environ[ENV_NUM_PROCESSES])
        pid = int(os.environ[ENV_PROCESS_ID])
        ndev = int(os.environ.get(ENV_LOCAL_DEVICES, "1"))
        heartbeat = int(os.environ.get(ENV_HEARTBEAT, "10"))
    except (KeyError, ValueError) as e:
        raise LaunchError(
            op="launch.initialize_from_env",
            must=f"{ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} are set to ints",
            given=str(e),
            fix="start the script with spmdkit.runtime.launch.launch / `spmdkit launch`",
        ) from e
    jax.config.update("jax_num_cpu_devices", ndev)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator,
        num_processes=nproc,
        process_id=pid,
        initialization_timeout=max(heartbeat * 6, 30),
        heartbeat_timeout_seconds=heartbeat,
        shutdown_timeout_seconds=heartbeat,
    )
    return True


def child_env(
    base: Mapping[str, str], *, coordinator: str, nproc: int, pid: int, ndev: int, heartbeat: int
) -> dict[str, str]:
    """The environment of process ``pid`` of ``nproc``: what :func:`initialize_from_env` reads.

    ``base`` plus the ``SPMDKIT_*`` variables, CPU as the platform, and ``ndev``
    virtual devices (replacing any device count already in ``XLA_FLAGS``). Useful
    to start the processes with another process manager than :func:`launch`.

    Args:
      base: the environment to start from.
      coordinator: ``host:port`` of process 0's coordinator.
      nproc: number of processes.
      pid: this process's id, ``0 <= pid < nproc``.
      ndev: virtual CPU devices of this process.
      heartbeat: ``jax.distributed`` heartbeat timeout (s).

    Example::

        >>> env = child_env(os.environ, coordinator="127.0.0.1:1234", nproc=2, pid=1,
        ...                 ndev=4, heartbeat=10)
        >>> env["SPMDKIT_PROCESS_ID"], env["JAX_PLATFORMS"]
        ('1', 'cpu')
    """
    env = dict(base)
    flags = [
        f
        for f in env.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    flags.append(f"--xla_force_host_platform_device_count={ndev}")
    env.update(
        {
            ENV_COORDINATOR: coordinator,
            ENV_NUM_PROCESSES: str(nproc),
            ENV_PROCESS_ID: str(pid),
            ENV_LOCAL_DEVICES: str(ndev),
            ENV_HEARTBEAT: str(heartbeat),
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": " ".join(flags),
        }
    )
    return env


def _stop(procs: Sequence[subprocess.Popen], grace: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        if p.poll() is None:
            try:
                p.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def launch(
    nproc: int,
    command: Sequence[str],
    *,
    devices_per_process: int = 1,
    port: int | None = None,
    timeout: float | None = None,
    heartbeat_s: int = 10,
    grace_s: float = 5.0,
    env: Mapping[str, str] | None = None,
    err: TextIO | None = None,
) -> int:
    """Run ``command`` as ``nproc`` local processes forming one JAX process group.

    Args:
      nproc: number of processes.
      command: the program and its arguments (e.g. ``[sys.executable, "train.py"]``);
        it must call :func:`initialize_from_env` before other JAX calls.
      devices_per_process: virtual CPU devices each process gets.
      port: coordinator port on 127.0.0.1 (default: a free one).
      timeout: stop everything and fail after this many seconds (default: no limit).
      heartbeat_s: ``jax.distributed`` heartbeat timeout given to the children.
      grace_s: seconds between SIGTERM and SIGKILL when stopping the others.
      env: base environment (default: this process's).
      err: where the launcher reports failures (default stderr).

    Returns:
      0 when every process succeeded; otherwise the first failing exit status
      (124 on timeout; 128+signal for a process killed by a signal).

    Example::

        >>> launch(2, [sys.executable, "train.py"], devices_per_process=4)
        0
    """
    err = err if err is not None else sys.stderr
    if not isinstance(nproc, int) or nproc < 1:
        raise LaunchError(
            op="launch", must="nproc is a positive int", given=repr(nproc), fix="nproc=2"
        )
    if not command:
        raise LaunchError(
            op="launch",
            must="a command to run is given",
            given="an empty command",
            fix="spmdkit launch --nproc 2 -- python train.py",
        )
    coordinator = f"127.0.0.1:{port or free_port()}"
    base = dict(os.environ if env is None else env)
    procs: list[subprocess.Popen] = []
    for pid in range(nproc):
        env_i = child_env(
            base,
            coordinator=coordinator,
            nproc=nproc,
            pid=pid,
            ndev=devices_per_process,
            heartbeat=heartbeat_s,
        )
        procs.append(subprocess.Popen(list(command), env=env_i))
    try:
        return _wait(procs, timeout, grace_s, err)
    except BaseException:
        _stop(procs, grace_s)
        raise


def _wait(
    procs: Sequence[subprocess.Popen], timeout: float | None, grace_s: float, err: TextIO
) -> int:
    """Poll until every process succeeded (0), one failed (its status, the others
    stopped) or ``timeout`` passed (124, all stopped)."""
    nproc = len(procs)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            i, code = failed[0]
            how = f"signal {-code}" if code < 0 else f"exit status {code}"
            err.write(
                f"spmdkit launch: process {i} of {nproc} failed ({how}); "
                f"stopping the other processes\n"
            )
            err.flush()
            _stop(procs, grace_s)
            return 128 - code if code < 0 else code
        if all(c == 0 for c in codes):
            return 0
        if deadline is not None and time.monotonic() > deadline:
            err.write(f"spmdkit launch: timed out after {timeout} s; stopping all\n")
            err.flush()
            _stop(procs, grace_s)
            return 124
        time.sleep(0.05)
