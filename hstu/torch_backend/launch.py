"""`train(cfg)`: the torch backend's entry point, which starts the ranks.

Under torchrun (RANK / WORLD_SIZE / MASTER_ADDR in the environment) every process runs its rank
directly and torchrun's world size wins over `dist.world_size`; otherwise `train` starts
`dist.world_size` processes itself (gloo on CPU, NCCL with one GPU per rank), or runs in-process
when the world is one rank. Each rank runs `train_step.run_rank`.

Failure handling, in one place (docs/robustness.md has the whole table):

* config, `output_dir` and world-size errors are raised here, before any rank starts (also
  what this backend cannot run with sharded tables, `sharding.check_sharding`, or without
  CUDA, `graphs.check_cuda_graphs`);
* collectives time out after `dist.timeout_s` (the process group's timeout);
* spawned ranks die with this process (parent-death signal SIGKILL; torch's own is SIGINT,
  which a rank started from a script ignores);
* when a rank fails, the others are stopped at once and the error names it: its HSTUError
  message, or how it died (signal, exit code, the watchdog);
* under torchrun the processes compare their configs once at start-up.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import shutil
import signal
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from hstu import watchdog
from hstu.config import config_from_dict
from hstu.data import source_from_config
from hstu.errors import HSTUError
from hstu.launch_checks import (
    CheckedSource,
    config_differences,
    config_mismatch_error,
    die_with_parent,
    preflight,
)
from hstu.torch_backend.graphs import check_cuda_graphs
from hstu.torch_backend.sharding import check_sharding
from hstu.torch_backend.train_step import run_rank

log = logging.getLogger(__name__)


def _torchrun_env() -> tuple[int, int, int] | None:
    env = os.environ
    if all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    return None


def resolve_device(name: str, num_local_ranks: int) -> str:
    """`dist.device` -> "cuda" | "cpu"; errors here, before any process or collective."""
    has_cuda = torch.cuda.is_available()
    if name in ("cuda", "gpu"):
        if not has_cuda:
            raise HSTUError(f"dist.device={name} but no CUDA device is available")
        if torch.cuda.device_count() < num_local_ranks:
            raise HSTUError(
                f"{num_local_ranks} ranks need one GPU each; found {torch.cuda.device_count()}"
            )
        return "cuda"
    if name == "auto" and has_cuda and torch.cuda.device_count() >= num_local_ranks:
        return "cuda"
    return "cpu"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _check_same_config(cfg, rank: int, world_size: int) -> None:
    """Once, at start-up (torchrun: every process parsed its own command line)."""
    mine = cfg.to_dict()
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, mine)
    for other, theirs in enumerate(everyone):
        diff = config_differences(mine, theirs) if other != rank else []
        if diff:
            raise config_mismatch_error(f"rank {rank}", f"rank {other}", diff)


def _init_and_run(
    cfg,
    rank: int,
    world_size: int,
    local_rank: int,
    device_type: str,
    init_method: str,
    source=None,
    compare_configs: bool = False,
) -> list[dict]:
    device = torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kwargs = {"device_id": device} if device.type == "cuda" else {}  # NCCL: bind eagerly
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=cfg.dist.timeout_s),
        **kwargs,
    )
    finished = False
    try:
        if compare_configs:
            _check_same_config(cfg, rank, world_size)
        source = CheckedSource(source if source is not None else source_from_config(cfg))
        rows = run_rank(cfg, rank, world_size, device, source=source)
        finished = True
        return rows
    finally:
        if finished or device.type != "cuda":
            dist.destroy_process_group()
        else:
            _abort_communicators()


def _abort_communicators() -> None:
    """A failing rank leaves its NCCL communicators without waiting for its peers: NCCL's
    orderly destroy can block on collectives the others never join, and then the rank never
    exits, so the launcher cannot stop the rest (they wait in a collective until the timeout)."""
    from torch.distributed import distributed_c10d

    try:
        distributed_c10d._abort_process_group()  # every group, the default one included
    except Exception as exc:  # noqa: BLE001 - the rank is failing already: keep its own error
        log.warning("aborting the NCCL communicators failed: %s", exc)


def _spawned(
    rank: int,
    world_size: int,
    cfg_dict: dict,
    device_type: str,
    port: int,
    out_dir: str,
    source,
    parent: int,
) -> None:
    die_with_parent(parent)
    message_file = Path(out_dir, f"rank{rank}.txt")
    # What an abort (the watchdog) says reaches the launcher through the same file.
    watchdog.add_abort_hook(lambda text: message_file.write_text(text))
    try:
        if device_type == "cpu":  # ranks share the cores: do not oversubscribe them
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        rows = _init_and_run(
            config_from_dict(cfg_dict),
            rank,
            world_size,
            rank,
            device_type,
            f"tcp://127.0.0.1:{port}",
            source,
        )
        if rank == 0:
            Path(out_dir, "rows.json").write_text(json.dumps(rows))
    except HSTUError as exc:
        message_file.write_text(str(exc))
        raise


def _failure(ctx, exc: Exception, out_dir: str) -> HSTUError:
    """The launcher's error for a failed rank: its own message when it left one, else how it
    ended (a rank killed by a signal is named even when others failed in a collective after)."""
    procs = ctx.processes
    messages = {r: Path(out_dir, f"rank{r}.txt") for r in range(len(procs))}
    first = getattr(exc, "error_index", None)
    killed = [
        r
        for r, p in enumerate(procs)
        if p.exitcode is not None and p.exitcode < 0 and -p.exitcode != signal.SIGTERM
    ]
    if first in killed or (killed and not messages[first].is_file()):
        r = first if first in killed else killed[0]
        name = signal.Signals(-procs[r].exitcode).name
        return HSTUError(
            f"rank {r} (pid {procs[r].pid}) died: killed by {name}; the other ranks were stopped"
        )
    for r in [first, *range(len(procs))]:
        if r is not None and messages[r].is_file():
            return HSTUError(messages[r].read_text())
    code = procs[first].exitcode if first is not None else None
    return HSTUError(
        f"rank {first} (pid {procs[first].pid if first is not None else '?'}) failed "
        f"(exit code {code}); the other ranks were stopped. Its error:\n{exc}"
    )


def _spawn_and_join(cfg, world_size: int, device_type: str, port: int, source) -> list[dict]:
    import torch.multiprocessing as mp

    out_dir = tempfile.mkdtemp(prefix="hstu-torch-")
    try:
        ctx = mp.start_processes(
            _spawned,
            args=(world_size, cfg.to_dict(), device_type, port, out_dir, source, os.getpid()),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        try:
            # A failed rank ends the others: 2 s to fail by themselves (every rank raises a
            # layout error, say), then SIGTERM, then SIGKILL after 2 s more.
            while not ctx.join(timeout=1.0, grace_period=2.0):
                pass
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            raise _failure(ctx, exc, out_dir) from None
        rows_path = Path(out_dir, "rows.json")
        return json.loads(rows_path.read_text()) if rows_path.is_file() else []
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(out_dir)


def train(cfg, source=None) -> list[dict]:
    """Train `cfg`; the launching process (or rank 0 under torchrun) gets the metric rows.
    `source`: the samples (a picklable `hstu.data.loader.SampleSource`; default: `cfg.data`'s)."""
    env = _torchrun_env()
    if env is not None:
        rank, world_size, local_rank = env
        preflight(cfg, "torch")
        die_with_parent()  # the torchrun agent; if it is killed, so are its ranks
        cfg.dist.world_size = world_size  # the launcher decides; config.yaml records it
        device_type = resolve_device(cfg.dist.device, local_rank + 1)
        check_sharding(cfg, device_type)
        check_cuda_graphs(cfg, device_type)
        return _init_and_run(
            cfg, rank, world_size, local_rank, device_type, "env://", source, world_size > 1
        )

    world_size = cfg.validate().dist.world_size
    device_type = resolve_device(cfg.dist.device, world_size)
    check_sharding(cfg, device_type)
    check_cuda_graphs(cfg, device_type)
    preflight(cfg, "torch", world_size if device_type == "cpu" else None)
    port = cfg.dist.master_port or _free_port()
    if world_size == 1 and not dist.is_initialized():
        return _init_and_run(cfg, 0, 1, 0, device_type, f"tcp://127.0.0.1:{port}", source)
    return _spawn_and_join(cfg, world_size, device_type, port, source)
