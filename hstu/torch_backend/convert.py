"""This backend's half of `hstu convert` (hstu/convert.py): a DCP `step-N` folder or a
`state_dict` file (`*.pt`) to / from the core-named portable state, on one process, without a
process group.
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
from hstu.torch_backend.checkpoint import MARKER, complete_steps
from hstu.torch_backend.state import make_optimizer, rank_seed
from hstu.trainer import data_position, data_state


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
    position = data_position(data[0], str(folder))
    return core.PortableState(step, model.export_params(), adam, data_state(position), str(folder))


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
