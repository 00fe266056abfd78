"""Sources that misbehave on purpose, and a runner for training them in a fresh process.

    python tests/multirank/robustness_workers.py <backend> <json spec>

runs `hstu.<backend>_backend.launch.train(cfg, source=...)` (jax: with `HSTU_TEST_DEVICES` host
devices, or as one process of several through the `JAX_*` variables) and prints `RESULT <json>`
last. The sources are picklable (torch ships them to spawned ranks) and build the demo samples
lazily from a config dict.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE_DIR = Path(tempfile.gettempdir()) / f"hstu-jax-test-cache-{os.getuid()}"


class DemoSource:
    """The config's synthetic samples, with a hook per sample (`changed`)."""

    def __init__(self, cfg_dict: dict):
        self.cfg_dict, self._inner = cfg_dict, None
        self.num_samples = cfg_dict["data"]["num_samples"]

    @property
    def inner(self):
        if self._inner is None:
            from hstu.config import config_from_dict
            from hstu.data import source_from_config

            self._inner = source_from_config(config_from_dict(self.cfg_dict))
        return self._inner

    @property
    def jagged_keys(self) -> tuple[str, ...]:
        return tuple(self.inner.jagged_keys)

    def sample(self, index: int) -> dict:
        return self.changed(index, dict(self.inner.sample(index)))

    def changed(self, index: int, sample: dict) -> dict:
        return sample


class RecordingSource(DemoSource):
    """Appends every index it serves to `<log_dir>/reads-<pid>.txt`; SIGKILLs its process
    when asked for sample `kill_at`."""

    def __init__(self, cfg_dict: dict, log_dir: str, kill_at: int | None = None):
        super().__init__(cfg_dict)
        self.log_dir, self.kill_at = log_dir, kill_at

    def changed(self, index: int, sample: dict) -> dict:
        if index == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        with open(Path(self.log_dir, f"reads-{os.getpid()}.txt"), "a") as f:
            f.write(f"{index} {int(sample['sample_id'])}\n")
        return sample


def recorded(log_dir) -> list[tuple[int, int]]:
    """Every `(index, sample_id)` served, all processes."""
    out = []
    for path in Path(log_dir).glob("reads-*.txt"):
        out += [tuple(map(int, line.split())) for line in path.read_text().splitlines()]
    return out


class ChangedSample(DemoSource):
    """Sample `index` altered when it is read: `key` set to `value` (a list, cast to `dtype`;
    `last`: only its last entry), or the process killed (`kill`), or hung forever (`hang`)."""

    def __init__(self, cfg_dict, index, key=None, value=None, dtype=None, action="set"):
        super().__init__(cfg_dict)
        self.index, self.key, self.value, self.dtype, self.action = (
            index,
            key,
            value,
            dtype,
            action,
        )

    def changed(self, index: int, sample: dict) -> dict:
        if index != self.index:
            return sample
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.action == "hang":
            while True:
                time.sleep(1)
        import numpy as np

        if self.action == "last":
            sample[self.key] = np.asarray(sample[self.key]).copy()
            sample[self.key][-1] = self.value
        else:
            sample[self.key] = np.asarray(self.value, dtype=self.dtype)
        return sample


class ShiftedTime(DemoSource):
    """Timestamps moved by `offset` (epoch milliseconds: 1.7e12; 0.5: fractional seconds, a
    float array), in sample `index` only or in every sample."""

    def __init__(self, cfg_dict, offset: float, index: int | None = None):
        super().__init__(cfg_dict)
        self.offset, self.index = offset, index

    def changed(self, index: int, sample: dict) -> dict:
        import numpy as np

        if self.index is None or index == self.index:
            for key in ("item_time", "candidate_time"):
                sample[key] = np.asarray(sample[key], np.int64) + self.offset
        return sample


class ExtraKeyOn(DemoSource):
    """One more jagged key ('extra') in the batches of JAX process `process`."""

    def __init__(self, cfg_dict, process: int):
        super().__init__(cfg_dict)
        self.process = process

    def _odd(self) -> bool:
        import jax

        return jax.process_index() == self.process

    @property
    def jagged_keys(self) -> tuple[str, ...]:
        return (*self.inner.jagged_keys, "extra") if self._odd() else tuple(self.inner.jagged_keys)

    def changed(self, index: int, sample: dict) -> dict:
        if self._odd():
            sample["extra"] = sample["item"]
        return sample


SOURCES = {
    "demo": DemoSource,
    "record": RecordingSource,
    "changed": ChangedSample,
    "time": ShiftedTime,
    "extra_key": ExtraKeyOn,
}


def make_source(cfg, spec: dict | None):
    if not spec:
        return None
    import robustness_workers  # by module name, not __main__: spawned ranks unpickle it

    spec = dict(spec)
    return robustness_workers.SOURCES[spec.pop("kind")](cfg.to_dict(), **spec)


# ------------------------------------------------------------------------------ layouts
def _drop_label(b):
    del b.lengths["label"], b.values["label"]


def _extra_key(b):
    b.lengths["extra"], b.values["extra"] = b.lengths["item"].copy(), b.values["item"].copy()


def _label_int32(b):
    b.values["label"] = b.values["label"].astype("int32")


def _sample_id_int32(b):
    b.dense["sample_id"] = b.dense["sample_id"].astype("int32")


def _extra_dense(b):
    import numpy as np

    b.dense["score"] = np.zeros((b.batch_size, 3), np.float32)


def _reordered(b):
    b.lengths["item"] = b.lengths.pop("item")
    b.values["item"] = b.values.pop("item")


# What rank 2's batch gets wrong, and what every rank's error must then say.
LAYOUT_CASES = {
    "missing": (_drop_label, "jagged key(s) 'label' missing"),
    "extra": (_extra_key, "extra jagged key(s) 'extra'"),
    "dtype": (_label_int32, "values['label'] of dtype int32 instead of int64"),
    "dense_dtype": (_sample_id_int32, "dense['sample_id'] of another dtype or shape"),
    "dense_extra": (_extra_dense, "an extra dense field 'score'"),
    "order": (_reordered, "the jagged keys in another order"),
}
ODD_RANK = 2


def layout_batches(case: str | None, world: int = 4, odd: int = ODD_RANK, batch_size: int = 4):
    """A global batch of the demo recipe with rank `odd`'s batch altered per `LAYOUT_CASES`."""
    from hstu.config import load_config
    from hstu.testing import DEMO_CONFIG, make_global_batch

    cfg = load_config(DEMO_CONFIG)
    batches = make_global_batch(cfg, batch_size, (4, 3, 4, 2, 1, 4, 3, 2)[:world])
    if case is not None:
        LAYOUT_CASES[case][0](batches[odd])
    return cfg, batches


def torch_layout_worker(rank: int, world: int, device: str, odd: int = ODD_RANK) -> dict:
    """Phase 1 of every layout case on a real process group: each rank's error, then one
    good batch through phase 1 (the group survived the errors)."""
    from hstu.errors import HSTUError
    from hstu.pipeline import Balancer, sample_stats
    from hstu.torch_backend.shuffler import TorchShuffler
    from hstu.workload import HSTUCost

    out = {}
    for case in [*LAYOUT_CASES, None]:
        cfg, batches = layout_batches(case, world, odd)
        cost = HSTUCost.from_model_config(cfg.model)
        balancer = Balancer(TorchShuffler(rank, world, device, 4), "balanced", overlap=False)
        try:
            _, stats, _ = balancer.phase1(None, sample_stats([batches[rank]], cost, "ranking"))
            out[str(case)] = f"ok {list(stats.shape)}"
        except HSTUError as exc:
            out[str(case)] = str(exc)
    return out


def jax_layout() -> dict:
    """Every layout case, and a rank of another batch size, through the JAX shuffler."""
    import jax

    from hstu.errors import HSTUError
    from hstu.jax_backend import collectives as col
    from hstu.jax_backend.shuffler import JaxShuffler
    from hstu.testing import make_global_batch
    from hstu.workload import HSTUCost

    mesh = col.make_mesh(jax.devices())
    out = {}
    for case in [*LAYOUT_CASES, "batch_size", None]:
        cfg, batches = layout_batches(case if case in LAYOUT_CASES else None)
        if case == "batch_size":
            batches[ODD_RANK] = make_global_batch(cfg, 5, (3,))[0]
        cost = HSTUCost.from_model_config(cfg.model)
        try:
            prepared = JaxShuffler(mesh).shuffle(batches, cost, "ranking")
            out[str(case)] = f"ok {list(prepared.stats.shape)}"
        except HSTUError as exc:
            out[str(case)] = str(exc)
    return out


def jax_inputs(tmp: str) -> dict:
    """Timestamps on 4 host devices: fractional seconds in one sample of rank 2, and epoch
    milliseconds with and without a time bias. Each outcome: "ok" or the error."""
    from hstu.config import load_config
    from hstu.errors import HSTUError
    from hstu.jax_backend.launch import train
    from hstu.testing import DEMO_CONFIG

    runs = {
        "fraction": ([], {"offset": 0.5, "index": 9}),
        "millis_unused": (["model.rab_time_buckets=0"], {"offset": 1_700_000_000_000}),
        "millis_used": (["model.rab_time_buckets=8"], {"offset": 1_700_000_000_000}),
    }
    out = {}
    for name, (extra, spec) in runs.items():
        overrides = ["dist.world_size=4", "data.batch_size=4", "train.steps=2", *extra]
        cfg = load_config(DEMO_CONFIG, [*overrides, "model.num_layers=1", f"output_dir={tmp}"])
        try:
            rows = train(cfg, source=ShiftedTime(cfg.to_dict(), **spec))
            out[name] = f"ok {len(rows)} steps"
        except HSTUError as exc:
            out[name] = str(exc)
    return out


# ------------------------------------------------------------------------------ processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(backend: str, overrides: list, source: dict | None = None, devices: int = 1, env=None):
    """A training process (`RESULT` line last); stdout and stderr go to files under a temp
    directory (`proc.out_path`, `proc.err_path`), so nothing blocks on a full pipe."""
    cmd = [sys.executable, str(Path(__file__).resolve()), backend, json.dumps([overrides, source])]
    full_env = dict(os.environ, JAX_PLATFORMS="cpu", HSTU_TEST_DEVICES=str(devices))
    full_env.setdefault("JAX_COMPILATION_CACHE_DIR", str(CACHE_DIR))
    full_env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    full_env.update(env or {})
    logs = Path(tempfile.mkdtemp(prefix="hstu-robust-"))
    with open(logs / "out.txt", "w") as out, open(logs / "err.txt", "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=out, stderr=err, text=True)
    proc.out_path, proc.err_path, proc.started = logs / "out.txt", logs / "err.txt", time.time()
    return proc


def finish(proc, timeout: float = 240) -> dict:
    """`{"code", "seconds", "stdout", "stderr", "result"}` once `proc` ended (killed after
    `timeout`: code None)."""
    try:
        proc.wait(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = None
    out, err = proc.out_path.read_text(), proc.err_path.read_text()
    shutil.rmtree(proc.out_path.parent, ignore_errors=True)
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    return {
        "code": code,
        "seconds": time.time() - proc.started,
        "stdout": out,
        "stderr": err,
        "result": json.loads(lines[-1][7:]) if lines else None,
    }


def finish_all(procs: list, timeout: float = 240) -> list[dict]:
    """`finish` of every process, each with `ended`: seconds from start to its exit (polled,
    so a process that dies first is timed when it dies)."""
    ended, deadline = {}, time.time() + timeout
    while len(ended) < len(procs) and time.time() < deadline:
        for i, p in enumerate(procs):
            if i not in ended and p.poll() is not None:
                ended[i] = time.time() - p.started
        time.sleep(0.05)
    outs = [finish(p, timeout=1) for p in procs]
    for i, out in enumerate(outs):
        out["ended"] = ended.get(i)
    return outs


def run(backend: str, overrides: list, source=None, devices: int = 1, timeout=240) -> dict:
    return finish(start(backend, overrides, source, devices), timeout)


def start_jax_processes(
    overrides: list, source=None, num: int = 2, devices: int = 2, extra: list | None = None
) -> list:
    """`num` processes of one run; `extra[i]`: overrides of process i alone."""
    port = free_port()
    return [
        start(
            "jax",
            [*overrides, *(extra[i] if extra else [])],
            source,
            devices,
            env={
                "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                "JAX_NUM_PROCESSES": str(num),
                "JAX_PROCESS_ID": str(i),
            },
        )
        for i in range(num)
    ]


def _main(backend: str, spec: str) -> None:
    if backend in ("jax_layout", "jax_inputs"):
        import jax

        jax.config.update("jax_num_cpu_devices", 4)
        result = jax_layout() if backend == "jax_layout" else jax_inputs(json.loads(spec)[0][0])
        print("RESULT " + json.dumps(result), flush=True)
        return
    overrides, source = json.loads(spec)
    from hstu.config import load_config
    from hstu.testing import DEMO_CONFIG

    cfg = load_config(DEMO_CONFIG, overrides)
    if backend == "jax":
        import jax

        jax.config.update("jax_num_cpu_devices", int(os.environ.get("HSTU_TEST_DEVICES", "1")))
        from hstu.jax_backend.launch import train
    else:
        from hstu.torch_backend.launch import train
    from hstu.errors import HSTUError

    try:
        rows = train(cfg, source=make_source(cfg, source))
    except HSTUError as exc:
        print(f"hstu: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    result = {"steps": [r["step"] for r in rows], "losses": [r["loss"] for r in rows]}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
