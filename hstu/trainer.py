"""The training loop both backends run, once: resume, config save, data position, metrics,
checkpoint cadence, and the call to `hstu.pipeline.run`.

A backend supplies two objects:

* a `TrainBackend`: the pipeline's Backend primitives plus what the loop reports (is this
  process the one that logs, the device's name for MFU, peak device memory);
* a `Checkpointer`: save / restore / latest step of its own training state (torch:
  torch.distributed.checkpoint, jax: Orbax), keeping the newest `train.keep_checkpoints`.

Behaviour every backend shares (tests hold both to it):

* checkpoints `step-N` at every multiple of `train.checkpoint_every` and at the last step, a
  line printed for each; `train.resume=true` continues from the newest complete one (and says
  so), or starts at step 0 when there is none;
* the data position saved with a checkpoint is the global sample index of the next batch, so a
  resumed run (with any world size) trains on exactly the samples that follow;
* `metrics.jsonl` starts over in a fresh run; a resumed run keeps the lines of the steps before
  it and rewrites the rest;
* the resolved config is printed and saved by the logging process only, after the launcher
  has fixed the world size;
* every batch is validated and checked against the model (`check_model_inputs`) on the host,
  before any collective;
* with a prepared dataset (`data.source=prepared`): an evaluation on the validation split every
  `train.eval_every` steps, early stopping, and the final test (`hstu.eval_loop`: it runs on
  the logging process, and every rank meets at one collective per evaluation).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from hstu import pipeline
from hstu.batch import ModelInputCheck
from hstu.data import packing
from hstu.data.loader import DataLoader, SampleSource
from hstu.data.workers import WorkerLoader
from hstu.metrics import MetricsLogger, peak_tflops
from hstu.watchdog import Watchdog
from hstu.workload import HSTUCost


class Checkpointer(Protocol):
    directory: Path  # holds the step-N folders

    def latest_step(self) -> int | None:
        """Newest complete checkpoint, or None."""

    def save(self, step: int, data_state: dict) -> Path:
        """Collective: write `step-<step>` (train state + `data_state`), keep the newest k."""

    def restore(self) -> tuple[int, dict] | None:
        """Collective: load the newest complete checkpoint into the live train state;
        `(step, data_state)`, or None when there is none."""

    def close(self) -> None:
        """Wait for pending writes."""


class TrainBackend(pipeline.Backend, Protocol):
    is_main: bool  # the process that prints, logs and saves the config (rank / process 0)
    device_name: str  # e.g. "NVIDIA H200" or "cpu": picks the MFU peak

    def memory_gib(self) -> float | None:
        """Peak device memory so far (GiB), or None where the device does not report it."""

    def probe(self, prepared: pipeline.Prepared, repeats: int, phases: bool = True) -> dict:
        """Collective (`bench.probe_every`): device timing of the step just fetched:
        `compute_s_before` / `compute_s_after`, every rank's forward + backward of its batch as
        loaded and as balanced, each alone on its device, and (`phases`) `device_s`, the step's
        phases."""

    def evaluator(self):
        """The logging process's `hstu.eval_loop.Scorer` of the live model (eval mode)."""

    def prepare_evaluation(self) -> None:
        """Collective, every rank, before each evaluation: bring to the logging process what
        its scorer needs that other ranks hold (torch: shards of sharded tables)."""

    def broadcast_flag(self, flag: bool) -> bool:
        """Collective: the logging process's `flag` on every rank."""


def data_state(position: int, source=None) -> dict:
    """The data state a checkpoint saves: the next sample, and the packing of the stream when
    `source` is packed (`hstu.data.packing`: a resume inside a window must read it alike)."""
    state = {"next_sample": int(position)}
    packed = packing.find_packed(source)
    if packed is not None:
        state["pack"] = packed.state()
    return state


def carried_data_state(state: dict, where: str = "checkpoint") -> dict:
    """A saved data state as a converted checkpoint carries it (position checked, packing kept)."""
    out = {"next_sample": data_position(state, where)}
    if state.get("pack") is not None:
        out["pack"] = state["pack"]
    return out


def data_position(state: dict, where: str = "checkpoint") -> int:
    from hstu.errors import HSTUError

    if "next_sample" not in state:
        raise HSTUError(
            f"{where} has no data position 'next_sample' (found {sorted(state)}): it was written "
            "by an older version that counted batches; start a fresh run"
        )
    return int(state["next_sample"])


def train(
    cfg,
    backend: TrainBackend,
    checkpointer: Checkpointer,
    source: SampleSource,
    backend_name: str,
    on_step: Callable[[int, dict], None] | None = None,
) -> list[dict]:
    """Train `cfg` to `cfg.train.steps`; the metric rows on the logging process, [] elsewhere."""
    tc, out_dir, main = cfg.train, Path(cfg.output_dir), backend.is_main

    def say(text: str) -> None:
        if main:
            (logger.print if logger else print)(text)

    logger = None
    start, position = 0, 0
    if main:
        print(f"# resolved config (backend={backend_name})\n{cfg.to_yaml()}", flush=True)
        cfg.save(out_dir / "config.yaml")
    if tc.resume:
        restored = checkpointer.restore()
        if restored is None:
            say(f"train.resume: no checkpoint under {checkpointer.directory}; starting at step 0")
        else:
            start, state = restored
            where = f"{checkpointer.directory}/step-{start}"
            position = data_position(state, where)
            packing.check_resume(source, position, state.get("pack"), where)
            say(f"resumed from {checkpointer.directory}/step-{start} (next sample {position})")
    if start >= tc.steps:
        say(f"nothing to train: the checkpoint is at step {start} >= train.steps={tc.steps}")
        return []
    loader = DataLoader(
        source, cfg.data.batch_size, backend.world_size, backend.local_ranks, position
    )
    positions: dict[int, int] = {}  # step -> data position after its batch
    evaluation = None
    if cfg.data.source == "prepared" and (tc.eval_every or cfg.eval.final_test):
        from hstu.eval_loop import TrainingEvaluation

        dataset = getattr(source, "inner", source)  # launch_checks.CheckedSource wraps it
        evaluation = TrainingEvaluation(cfg, dataset, backend, out_dir, start, say)
    progress = {"done": start, "stop": False}

    def batches():
        step = start
        while True:
            batch = next(loader)
            positions[step] = loader.position
            step += 1
            yield batch

    if main:
        logger = MetricsLogger(
            out_dir,
            tc.steps,
            tc.log_every,
            peak_tflops(backend.device_name, tc.peak_tflops),
            start_step=start,
            tensorboard=tc.tensorboard,
        )
        if evaluation is not None:
            evaluation.tb = logger.tb

    def after_dispatch(step: int) -> bool:
        """Evaluation and checkpoint cadence; True when either held up the host (the next
        step's period). Every rank makes the same calls (both are collective)."""
        watchdog.beat()
        done = step + 1
        progress["done"] = done
        evaluated = evaluation is not None and evaluation.due(done)
        if evaluated:
            progress["stop"] = evaluation.after_step(done, watchdog.beat)
            watchdog.beat()
        last = done == tc.steps or progress["stop"]
        if tc.checkpoint_every and (done % tc.checkpoint_every == 0 or last):
            path = checkpointer.save(done, data_state(positions.pop(step), source))
            say(f"checkpoint: saved {path} (the state after step {step})")
            watchdog.beat()
            return True
        positions.pop(step, None)
        return evaluated

    def metrics_ready(step: int, metrics: dict) -> None:
        watchdog.beat()
        metrics["max_memory_gib"] = backend.memory_gib()
        if logger is not None:
            logger.log(step, metrics)
        if on_step is not None:
            on_step(step, metrics)

    bench = cfg.bench

    def probe(step: int, prepared) -> dict | None:
        done = step - start + 1
        if bench.probe_every and done > bench.probe_after and step % bench.probe_every == 0:
            return backend.probe(prepared, bench.probe_repeats, bench.probe_phases)
        return None

    max_seqlen = cfg.data.max_seqlen
    cost = HSTUCost.from_model_config(cfg.model)
    check = ModelInputCheck(cfg.model, max_seqlen)
    if cfg.data.workers:  # batches built and prepared in processes of their own
        prep = pipeline.BatchPrep(tuple(backend.local_ranks), cost, cfg.model.task, True, check)
        loader = WorkerLoader(loader, cfg.data.workers, cfg.data.prefetch + 1, prep)
    # No step dispatched for train.watchdog_s: every thread's stack, then the run ends.
    watchdog = Watchdog(tc.watchdog_s, f"rank(s) {list(backend.local_ranks)}").start()
    try:
        rows = pipeline.run(
            backend,
            batches(),
            tc.steps - start,
            cost,
            cfg.model.task,
            cfg.balance.shuffler,
            cfg.balance.method,
            cfg.balance.overlap,
            on_step=metrics_ready,
            start_step=start,
            prefetch=cfg.data.prefetch,
            check=check,
            after_dispatch=after_dispatch,
            probe=probe if bench.probe_every else None,
            should_stop=lambda step: progress["stop"],
            prepared=bool(cfg.data.workers),
            lag=tc.metrics_lag,
        )
        if evaluation is not None:
            evaluation.finish(progress["done"], watchdog.beat)
    finally:
        try:
            checkpointer.close()  # pending saves: the watchdog still covers a hang here
            if logger is not None:
                logger.close()
        finally:
            watchdog.stop()
            if isinstance(loader, WorkerLoader):
                loader.close()
    return rows if main else []
