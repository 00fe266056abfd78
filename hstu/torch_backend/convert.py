"""This backend's half of `hstu convert` (hstu/convert.py): a DCP `step-N` folder or a
`state_dict` file (`*.pt`) to / from the core-named portable state, on one process, without a
process group.

A checkpoint of sharded tables (checkpoint.py's `tables_opt` layout) is read into whole
tensors (DCP gathers the shards of any sharding and world size) and written as whole tensors
that a sharded run reads back into its own shards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hstu import convert as core
from hstu.errors import HSTUError
from hstu.torch_backend.checkpoint import (
    MARKER,
    SHARDED_KEY,
    checkpoint_layout,
    complete_steps,
)
from hstu.torch_backend.state import make_optimizer, rank_seed
from hstu.trainer import carried_data_state

ADAM_KEYS = ("exp_avg", "exp_avg_sq")


@contextlib.contextmanager
def _single_process():
    # DCP warns that it runs without a process group: that is what conversion means to do.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*process group.*")
        warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
        yield


def _model_and_optimizer(cfg):
    from hstu.torch_backend.model import HSTUModel

    # The attention implementation holds no parameters; the reference builds on any device.
    model = HSTUModel(dataclasses.replace(cfg.model, attention="reference"), "cpu")
    return model, make_optimizer(list(model.parameters()), cfg.train)


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float32).numpy().copy()


def read_portable(path: Path, cfg) -> core.PortableState:
    """A `state_dict` file (parameters only) or a DCP `step-N` folder (the newest complete one
    under a run or checkpoints directory) as a core-named portable state."""
    from hstu.torch_backend.model import HSTUModel

    path = Path(path)
    if core.is_params_file(path):
        if not path.is_file():
            raise HSTUError(f"checkpoint source {str(path)!r} does not exist")
        state_dict = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(state_dict, dict) or not all(
            isinstance(v, torch.Tensor) for v in state_dict.values()
        ):
            raise HSTUError(f"{path} is not a torch state_dict (a flat name -> tensor mapping)")
        params = {HSTUModel.core_name(k): _to_numpy(v) for k, v in state_dict.items()}
        return core.PortableState(0, params, source=str(path))
    folder = core.source_step_dir(path, complete_steps)
    if not (folder / MARKER).is_file():
        raise HSTUError(f"{folder} is not a complete torch checkpoint (no {MARKER} marker)")
    step = core.step_of(folder)
    extras = sorted(folder.glob("extra-rank*.pt"))
    if not extras:
        raise HSTUError(f"{folder} has no extra-rank<r>.pt (data state): not a torch checkpoint")
    data = [torch.load(p, weights_only=True)["data"] for p in extras]
    if any(d != data[0] for d in data):
        raise HSTUError(f"{folder}: the ranks' data states differ: {data}")
    if checkpoint_layout(folder) == "sharded":
        params, adam, tables = _read_sharded(folder, cfg)
        carried = carried_data_state(data[0], str(folder))
        state = core.PortableState(step, params, adam, carried, str(folder))
        state.tables = tables
        return state
    model, optimizer = _model_and_optimizer(cfg)
    with _single_process():
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
    named = model.named_core_parameters()
    per_param = {name: optimizer.state[p] for name, p in named.items()}
    counts = {int(s["step"]) for s in per_param.values()}
    if len(counts) != 1:
        raise HSTUError(f"{folder}: parameters disagree on the AdamW step count: {sorted(counts)}")
    adam = core.AdamState(
        counts.pop(),
        {name: _to_numpy(s["exp_avg"]) for name, s in per_param.items()},
        {name: _to_numpy(s["exp_avg_sq"]) for name, s in per_param.items()},
    )
    carried = carried_data_state(data[0], str(folder))
    return core.PortableState(step, model.export_params(), adam, carried, str(folder))


def _torch_table(core_name: str) -> str:
    return "embedding.embeddings." + core_name.removeprefix(core.TABLE_PREFIX) + ".weight"


def _sharded_entries(cfg, optimizer: str) -> dict:
    """Whole (unsharded) tensors in the DCP layout of sharded tables (checkpoint.py): DCP
    reads any sharding into them and a sharded run reads them back into its shards."""
    dense, tables = core.dense_shapes(cfg.model), core.table_shapes(cfg.model)
    model = {n: torch.zeros(s) for n, s in dense.items()}
    model |= {_torch_table(n): torch.zeros(s) for n, s in tables.items()}
    optim = {f"{n}.{k}": torch.zeros(s) for n, s in dense.items() for k in ADAM_KEYS}
    optim["step"] = torch.zeros(1)
    fields = {"sum": lambda s: (s[0],)} if optimizer == "row_wise_adagrad" else {}
    fields = fields or {"m": lambda s: s, "v": lambda s: s}
    table_opt = {
        f"{n}.{f}": torch.zeros(shape(s)) for n, s in tables.items() for f, shape in fields.items()
    }
    table_opt["count"] = torch.zeros(1, dtype=torch.int64)
    return {"model": model, "optim": optim, SHARDED_KEY: table_opt}


def _read_sharded(folder: Path, cfg):
    keys = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    sums = any(k.endswith(".sum") for k in keys if k.startswith(SHARDED_KEY + "."))
    optimizer = "row_wise_adagrad" if sums else "adam"
    entries = _sharded_entries(cfg, optimizer)
    with _single_process():
        dcp.load(entries, checkpoint_id=folder)
    model, optim, table_opt = entries["model"], entries["optim"], entries[SHARDED_KEY]
    params = {n: _to_numpy(v) for n, v in model.items() if n in core.dense_shapes(cfg.model)}
    params |= {n: _to_numpy(model[_torch_table(n)]) for n in core.table_shapes(cfg.model)}
    dense = core.dense_shapes(cfg.model)
    adam = core.AdamState(
        int(optim["step"][0]),
        {n: _to_numpy(optim[f"{n}.exp_avg"]) for n in dense},
        {n: _to_numpy(optim[f"{n}.exp_avg_sq"]) for n in dense},
    )
    per = {f: {} for f in ("sum", "m", "v")}
    for key, value in table_opt.items():
        if key != "count":
            name, field = key.rsplit(".", 1)
            per[field][name] = _to_numpy(value)
    tables = core.TableOptState(optimizer, int(table_opt["count"][0]), **per)
    return params, adam, tables


def _write_sharded(state: core.PortableState, folder: Path, cfg) -> None:
    entries = _sharded_entries(cfg, state.tables.optimizer)
    for name, value in state.params.items():
        key = _torch_table(name) if name.startswith(core.TABLE_PREFIX) else name
        entries["model"][key] = torch.from_numpy(np.array(value, np.float32))
    for name in core.dense_shapes(cfg.model):
        entries["optim"][f"{name}.exp_avg"] = torch.from_numpy(np.array(state.adam.mu[name]))
        entries["optim"][f"{name}.exp_avg_sq"] = torch.from_numpy(np.array(state.adam.nu[name]))
    entries["optim"]["step"] = torch.tensor([float(state.adam.count)])
    for field in ("sum", "m", "v"):
        for name, value in getattr(state.tables, field).items():
            entries[SHARDED_KEY][f"{name}.{field}"] = torch.from_numpy(np.array(value, np.float32))
    entries[SHARDED_KEY]["count"] = torch.tensor([state.tables.count], dtype=torch.int64)
    with _single_process():
        dcp.save(entries, checkpoint_id=folder)


def _check_sharding_matches(state: core.PortableState, cfg) -> None:
    e = cfg.embedding
    if (state.tables is not None) != e.sharded:
        held = (
            f"sharded tables ({state.tables.optimizer})"
            if state.tables is not None
            else "replicated tables (AdamW on every parameter)"
        )
        raise HSTUError(
            f"{state.source or 'the checkpoint'} holds {held}; the target config has "
            f"embedding.sharding={e.sharding}: set embedding.sharding to match (any sharding "
            "but none reads sharded tables)"
        )
    if state.tables is not None and state.tables.optimizer != e.optimizer:
        raise HSTUError(
            f"the checkpoint's tables use embedding.optimizer={state.tables.optimizer}, the "
            f"target config has embedding.optimizer={e.optimizer}"
        )


def write_portable(state: core.PortableState, path: Path, cfg) -> Path:
    """Write `state` as a `state_dict` file (`*.pt`, parameters only) or as a complete DCP
    `step-N` folder that `train.resume=true` picks up: one `extra-rank<r>.pt` per rank of
    `cfg.dist.world_size`, each with the data state and its rank's seeded initial RNG state."""
    model, optimizer = _model_and_optimizer(cfg)
    model.load_params(state.params)
    path = Path(path)
    if core.is_params_file(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), path)
        return path
    folder = core.dest_step_dir(path, state.step)
    if folder.exists():
        raise HSTUError(f"{folder} exists already; refusing to overwrite a checkpoint")
    assert state.adam is not None and state.data is not None  # checked by hstu.convert
    _check_sharding_matches(state, cfg)
    if state.tables is not None:
        _write_sharded(state, folder, cfg)
    else:
        for name, p in model.named_core_parameters().items():
            optimizer.state[p] = {
                "step": torch.tensor(float(state.adam.count), dtype=torch.float32),
                "exp_avg": torch.from_numpy(np.array(state.adam.mu[name], np.float32)),
                "exp_avg_sq": torch.from_numpy(np.array(state.adam.nu[name], np.float32)),
            }
        with _single_process():
            model_state, optim_state = get_state_dict(model, optimizer)
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
    for rank in range(cfg.dist.world_size):
        rng = torch.Generator().manual_seed(rank_seed(cfg.train.seed, rank)).get_state()
        extra = {"step": state.step, "data": dict(state.data), "rng": {"torch": rng}}
        torch.save(extra, folder / f"extra-rank{rank}.pt")
    (folder / MARKER).write_text(f"{state.step}\n")
    return folder
