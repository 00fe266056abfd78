"""Backend-neutral checkpoints: one portable training state that either backend reads and writes.

Both backends hold exactly the parameters of `hstu.params` (same shapes, linear kernels
`[in, out]`), so a checkpoint converts by renaming nothing: the portable state is keyed by the
core names, and each backend maps its native names onto them in its own `convert.py` (torch:
TorchRec's `embedding.embeddings.<table>.weight` is `embedding.<table>`; Flax: `layers_<i>` is
`layers.<i>`). Training checkpoints themselves are each backend's `checkpoint.py`. What converts:

* parameters (fp32);
* AdamW state: first and second moments per parameter and the step count (torch
  `exp_avg` / `exp_avg_sq` / `step` == optax `ScaleByAdamState.mu` / `nu` / `count`: the two
  optimizers compute the same update, see docs/MODEL.md);
* the training step and the data position (the global index of the next sample, the same on
  every rank and for any world size);
* with sharded tables (`embedding.sharding` != none): `tables`, the tables' own optimizer
  state (`TableOptState`, whole tables, any sharding and world size), and then `adam` holds
  the dense parameters only (`dense_shapes`); `params` always holds every parameter.

What does not: RNG streams (a torch generator state has no JAX counterpart). The writer
gives the target its own seeded initial RNG state, exactly what a fresh run of that backend
starts from; the RNG only drives dropout, so with `model.dropout=0` a converted run continues
the source run's loss curve to float tolerance.

Locations (`SRC` / `DST` of `hstu convert`): a run's output directory (its `checkpoints/`
holds `step-N` folders), a checkpoints root, or one `step-N` folder; or a parameters-only file:
`*.pt` (a torch `state_dict`) or `*.msgpack` (Flax `{"params": tree}` bytes).

This module imports neither torch nor jax; `convert` loads the two backends' halves lazily.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hstu.errors import HSTUError
from hstu.params import param_shapes

BACKENDS = ("torch", "jax")
PARAMS_SUFFIX = {"torch": ".pt", "jax": ".msgpack"}
STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclass
class AdamState:
    """AdamW moments by core name, and the number of optimizer steps taken."""

    count: int
    mu: dict[str, np.ndarray]  # first moments (torch exp_avg)
    nu: dict[str, np.ndarray]  # second moments (torch exp_avg_sq)


@dataclass
class TableOptState:
    """The optimizer state of sharded embedding tables (`embedding.sharding` != none), by
    table core name (`embedding.item`, ...), gathered whole: a checkpoint of any sharding and
    world size reads into any other. docs/MODEL.md defines the update.

    * `row_wise_adagrad`: `sum[name]` `[rows]`, the accumulated mean squared row gradient;
    * `adam`: `m[name]`, `v[name]` `[rows, D]`, and `count`, the optimizer steps taken (the
      bias correction's t).
    """

    optimizer: str  # embedding.optimizer
    count: int
    sum: dict[str, np.ndarray]
    m: dict[str, np.ndarray]
    v: dict[str, np.ndarray]

    def validate(self, model_cfg, where: str = "") -> None:
        from hstu.embedding_opt import OPTIMIZERS

        if self.optimizer not in OPTIMIZERS:
            raise HSTUError(
                f"table optimizer{where} is {self.optimizer!r}, not one of {list(OPTIMIZERS)}"
            )
        if self.count < 0:
            raise HSTUError(f"table optimizer step count{where} is negative: {self.count}")
        tables = table_shapes(model_cfg)
        rows = {n: (shape[0],) for n, shape in tables.items()}
        fields = (
            {"sum": rows} if self.optimizer == "row_wise_adagrad" else {"m": tables, "v": tables}
        )
        for field in ("sum", "m", "v"):
            held = getattr(self, field)
            if field not in fields:
                if held:
                    raise HSTUError(f"{self.optimizer} state{where} has {field!r}: it has none")
                continue
            what = f"{self.optimizer} state {field!r} of the tables{where}"
            check_names(held, model_cfg, what, fields[field])


@dataclass
class PortableState:
    """A training checkpoint in core names; `adam` and `data` are None for parameters only."""

    step: int
    params: dict[str, np.ndarray]
    adam: AdamState | None = None
    data: dict | None = None  # {"next_sample": int}: the data position (hstu.trainer)
    source: str = ""  # where it was read from (messages only)
    # sharded tables: their own optimizer's state; `adam` then holds the dense parameters only
    tables: TableOptState | None = None

    @property
    def is_training_state(self) -> bool:
        return self.adam is not None and self.data is not None

    def validate(self, model_cfg) -> PortableState:
        """Names and shapes against `hstu.params.param_shapes`; HSTUError naming the tensor.

        With `tables`, the AdamW moments cover the dense parameters only (`dense_shapes`) and
        `tables` holds, for every table (`table_shapes`), `sum` `[rows]` (row_wise_adagrad) or
        `m` and `v` `[rows, D]` (adam)."""
        where = f" in {self.source}" if self.source else ""
        check_names(self.params, model_cfg, f"parameters{where}")
        adam_shapes = param_shapes(model_cfg) if self.tables is None else dense_shapes(model_cfg)
        if self.adam is not None:
            check_names(self.adam.mu, model_cfg, f"AdamW first moments{where}", adam_shapes)
            check_names(self.adam.nu, model_cfg, f"AdamW second moments{where}", adam_shapes)
            if self.adam.count < 0:
                raise HSTUError(f"AdamW step count{where} is negative: {self.adam.count}")
        if self.tables is not None:
            self.tables.validate(model_cfg, where)
        if self.step < 0:
            raise HSTUError(f"checkpoint step{where} is negative: {self.step}")
        if self.data is not None and int(self.data.get("next_sample", -1)) < 0:
            raise HSTUError(f"data state{where} has no valid 'next_sample': {self.data}")
        return self


TABLE_PREFIX = "embedding."


def table_shapes(model_cfg) -> dict[str, tuple[int, ...]]:
    """The embedding tables (`embedding.item`, ...): what `embedding.sharding` shards."""
    return {n: s for n, s in param_shapes(model_cfg).items() if n.startswith(TABLE_PREFIX)}


def dense_shapes(model_cfg) -> dict[str, tuple[int, ...]]:
    """Every parameter but the tables: what AdamW updates when the tables are sharded."""
    return {n: s for n, s in param_shapes(model_cfg).items() if not n.startswith(TABLE_PREFIX)}


def check_names(
    tensors: dict[str, np.ndarray], model_cfg, what: str, expected: dict | None = None
) -> None:
    expected = param_shapes(model_cfg) if expected is None else expected
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise HSTUError(
            f"{what} do not match the configured model: missing {missing}, "
            f"unexpected {unexpected} (check --config)"
        )
    for name, arr in tensors.items():
        if tuple(np.shape(arr)) != expected[name]:
            raise HSTUError(
                f"{what}: {name} has shape {list(np.shape(arr))}, the configured model "
                f"expects {list(expected[name])} (check --config)"
            )


# ------------------------------------------------------------------------------ locations
def is_params_file(path: str | Path) -> bool:
    return Path(path).suffix in PARAMS_SUFFIX.values()


def step_of(path: Path) -> int | None:
    m = STEP_DIR.match(Path(path).name)
    return int(m.group(1)) if m else None


def checkpoints_root(path: str | Path) -> Path:
    """The folder holding `step-N` folders, from a run's output dir or the root itself."""
    path = Path(path)
    return path / "checkpoints" if (path / "checkpoints").is_dir() else path


def source_step_dir(path: str | Path, complete_steps) -> Path:
    """The `step-N` folder to read: `path` itself, or the newest complete one under it.

    `complete_steps(root) -> sorted list of ints` is the backend's notion of a finished save.
    """
    path = Path(path)
    if not path.exists():
        raise HSTUError(f"checkpoint source {str(path)!r} does not exist")
    if step_of(path) is not None:
        return path
    root = checkpoints_root(path)
    steps = complete_steps(root)
    if not steps:
        raise HSTUError(f"no complete step-N checkpoint under {str(root)!r}")
    return root / f"step-{steps[-1]}"


def dest_step_dir(path: str | Path, step: int) -> Path:
    """Where to write step `step`: `path` if it is named `step-N`, else under its checkpoints
    root (`path/checkpoints/` unless `path` is itself named `checkpoints`)."""
    path = Path(path)
    named = step_of(path)
    if named is not None:
        if named != step:
            raise HSTUError(f"destination {path} names step {named}, the checkpoint is step {step}")
        return path
    root = path if path.name == "checkpoints" else path / "checkpoints"
    return root / f"step-{step}"


def find_run_config(path: str | Path) -> Path | None:
    """`config.yaml` of the run a checkpoint belongs to (the nearest one above it)."""
    path = Path(path).absolute()
    for parent in [path, *path.parents][:4]:
        if (parent / "config.yaml").is_file():
            return parent / "config.yaml"
    return None


# ------------------------------------------------------------------------------ conversion
def backend_convert(name: str):
    """`hstu.<name>_backend.convert`, imported on demand (the core never imports it)."""
    if name not in BACKENDS:
        raise HSTUError(f"unknown backend {name!r}; choose from {list(BACKENDS)}")
    from hstu import backends

    ok, why = backends.available(name)
    if not ok:
        raise HSTUError(why)
    return importlib.import_module(f"hstu.{name}_backend.convert")


def convert(src_backend: str, dst_backend: str, src: str | Path, dst: str | Path, cfg):
    """Read `src` with one backend, write it to `dst` with the other; `(state, written path)`.

    A parameters-only source cannot become a training checkpoint: resuming needs the AdamW
    moments and the data position, which such a file does not hold.
    """
    for backend, path in ((src_backend, src), (dst_backend, dst)):
        if is_params_file(path) and Path(path).suffix != PARAMS_SUFFIX[backend]:
            raise HSTUError(
                f"a {backend} parameters file ends with {PARAMS_SUFFIX[backend]}, got {path}"
            )
    reader, writer = backend_convert(src_backend), backend_convert(dst_backend)
    state = reader.read_portable(Path(src), cfg).validate(cfg.model)
    if not is_params_file(dst) and not state.is_training_state:
        raise HSTUError(
            f"{src} holds parameters only (no optimizer or data state); write it to a "
            f"parameters file ({' or '.join(PARAMS_SUFFIX.values())}) instead"
        )
    written = writer.write_portable(state, Path(dst), cfg)
    run_dir = Path(dst)
    if written.parent.parent == run_dir and not (run_dir / "config.yaml").exists():
        cfg.save(run_dir / "config.yaml")  # DST is a run directory: later commands find it
    return state, written


def describe(state: PortableState) -> str:
    parts = [f"step {state.step}", f"{len(state.params)} parameters"]
    if state.adam is not None:
        dense = " of the dense parameters" if state.tables is not None else ""
        parts.append(f"AdamW moments{dense} (count {state.adam.count})")
    if state.tables is not None:
        parts.append(f"sharded tables' {state.tables.optimizer} state (count {state.tables.count})")
    if state.data is not None:
        parts.append(f"data next_sample={state.data['next_sample']}")
    return ", ".join(parts)
