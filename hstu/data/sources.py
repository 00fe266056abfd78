"""The sample source a config names (`data.source`), and the checks a prepared source needs
before any rank starts.

* `synthetic` (the default): `hstu.data.synthetic`'s seeded generator;
* `prepared`: a directory written by `hstu data prepare` (`hstu.data.prepared`), opened
  memory-mapped with the sampling the config asks for (`PreparedSpec.from_config`).

`check_prepared(cfg)` holds the config against the prepared manifest: the model's tables must
hold the dataset's ids (`model.num_items`, `num_actions`, `num_contextual_ids`), a ranking model
cannot predict more tasks than the dataset labels (`model.num_tasks`), and
`data.num_contextual` is the dataset's contextual feature count (or 0: ignore them). Every
error names the key, the value it needs and the manifest, and is raised in the launching
process, before any rank starts.
"""

from __future__ import annotations

from pathlib import Path

from hstu.errors import HSTUError


def source_from_config(cfg):
    """The `hstu.data.loader.SampleSource` of `cfg.data` (reordered window by window with
    `data.pack_window`: `hstu.data.packing`)."""
    if cfg.data.source == "prepared":
        source = open_prepared(cfg)
    else:
        from hstu.data.synthetic import source_from_config as synthetic

        source = synthetic(cfg)
    if not cfg.data.pack_window:
        return source
    from hstu import capacity
    from hstu.data.packing import PackedSource

    policy = capacity.block_policy(cfg, source)
    return PackedSource(source, cfg.data.pack_window, cfg.data.batch_size, policy)


def open_prepared(cfg):
    """The prepared dataset of `cfg.data.path`, sampled as `cfg` asks (checked first)."""
    from hstu.data.prepared import PreparedDataset, PreparedSpec

    check_prepared(cfg)
    return PreparedDataset(cfg.data.path, PreparedSpec.from_config(cfg))


def check_prepared(cfg) -> None:
    """Raise HSTUError naming each config key that does not fit the prepared dataset."""
    from hstu.data.manifest import MANIFEST, Manifest

    d, m = cfg.data, cfg.model
    path = Path(d.path)
    if not path.is_dir():
        raise HSTUError(
            f"data.path={d.path!r} is not a directory: give the output of `hstu data prepare`"
        )
    manifest = Manifest.load(path)
    where = f"{manifest.dataset} (manifest {path / MANIFEST})"
    problems = []

    def need(key: str, have, want, why: str) -> None:
        problems.append(f"{key}={have} but {why}: set {key}={want}")

    if m.num_items < manifest.num_items:
        need(
            "model.num_items", m.num_items, manifest.num_items, f"it has {manifest.num_items} items"
        )
    if m.num_actions < manifest.num_actions:
        why = f"its action ids are {manifest.action_meaning} ({manifest.num_actions} ids)"
        need("model.num_actions", m.num_actions, manifest.num_actions, why)
    if d.num_contextual not in (0, manifest.num_contextual):
        names = manifest.contextual_names
        need(
            "data.num_contextual",
            d.num_contextual,
            f"{manifest.num_contextual} (or 0 to ignore them)",
            f"it has {manifest.num_contextual} contextual features {names} per user",
        )
    elif d.num_contextual and m.num_contextual_ids < manifest.num_contextual_ids:
        need(
            "model.num_contextual_ids",
            m.num_contextual_ids,
            manifest.num_contextual_ids,
            f"its contextual features take {manifest.num_contextual_ids} ids",
        )
    tasks = manifest.task_names
    if m.task == "ranking":
        if m.num_tasks > len(tasks):
            need(
                "model.num_tasks",
                m.num_tasks,
                f"at most {len(tasks)}",
                f"it labels {len(tasks)} tasks {tasks}",
            )
        if d.max_candidates < 1:
            need("data.max_candidates", d.max_candidates, "K >= 1", "ranking samples need K")
        metric = cfg.eval.early_stop_metric
        kept = tasks[: m.num_tasks]
        if metric and metric.split("/", 1)[1:] and metric.split("/", 1)[1] not in kept:
            need(
                "eval.early_stop_metric",
                repr(metric),
                f"{metric.split('/')[0]}/<task> with a task of {kept}",
                "the model predicts no such task",
            )
    elif d.max_history < 2:
        need("data.max_history", d.max_history, ">= 2", "a retrieval sample needs a target")
    if problems:
        raise HSTUError(f"the config does not fit {where}: " + "; ".join(problems))
