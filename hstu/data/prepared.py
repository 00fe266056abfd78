"""HSTU samples from a prepared directory (`hstu data prepare`), in `make_sample`'s dict form.

What a training sample is (only train-split events are ever used; an epoch visits every train
event once as a target):

* ranking: `num_candidates` (K) consecutive train events of one user are the candidates, the
  up to `max_history` events before them the history. A user's train events from position
  `min_history` on are cut into chunks of K from the most recent backwards (the oldest chunk
  may be shorter), so each event is a candidate once an epoch. Labels are the dataset's task
  bitmask of the candidate's action (`manifest.label_of_action`), low `num_tasks` bits kept.
* retrieval: a window of up to `max_history` train events; every event but the first is a
  next-item target, as in the synthetic data. Windows are cut from the most recent backwards
  and overlap by one event, so each train event after a user's first is a target once an
  epoch. No candidates. With `num_negatives` R > 0 a `negative` key holds (L - 1) * R item ids
  drawn uniformly from the corpus by a generator seeded by (seed, global index): they do not
  depend on the rank a sample lands on.

Global index `i` is sample `perm_e[i % num_samples]` of epoch `e = i // num_samples`, where
`perm_e` is a permutation seeded by (seed, e): the same on every rank and machine. The sample's
`sample_id` is `i`, unique across epochs.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hstu.batch import HSTU_JAGGED_KEYS
from hstu.data.manifest import Manifest, open_arrays, verify_checksums
from hstu.errors import HSTUError

# Stream tags keep the generators of different purposes apart for equal (seed, index) pairs.
_PERMUTATION, _NEGATIVES, _EVAL_NEGATIVES = 0, 1, 2
SPLITS = ("valid", "test")


@dataclass(frozen=True)
class PreparedSpec:
    task: str = "ranking"  # ranking | retrieval
    max_history: int = 64  # history events per sample (the most recent ones)
    min_history: int = 1  # ranking: events before a user's first candidate
    num_candidates: int = 4  # ranking: K candidates per sample
    num_negatives: int = 0  # retrieval: sampled negatives per target (0: no "negative" key)
    num_tasks: int | None = None  # label bits kept; None: every task of the dataset
    seed: int | None = None  # None: the seed recorded in the manifest
    use_contextual: bool = True  # False: samples carry no contextual ids (the papers' setting)

    def __post_init__(self):
        def check(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise HSTUError(f"PreparedSpec.{name}={getattr(self, name)!r} {why}")

        check(self.task in ("ranking", "retrieval"), "task", "must be ranking or retrieval")
        check(self.max_history >= 1, "max_history", "must be >= 1")
        if self.task == "retrieval":
            check(self.max_history >= 2, "max_history", "must be >= 2 to hold a target")
        check(0 <= self.min_history <= self.max_history, "min_history", "must be in [0, max]")
        if self.task == "ranking":  # retrieval samples have no candidates
            check(self.num_candidates >= 1, "num_candidates", "must be >= 1")
        check(self.num_negatives >= 0, "num_negatives", "must be >= 0")
        check(self.num_tasks is None or self.num_tasks >= 1, "num_tasks", "must be >= 1")

    @classmethod
    def from_config(cls, cfg) -> PreparedSpec:
        """The sampling that a training config asks for: `data.max_history`,
        `data.min_history`, `data.max_candidates` (K), `data.seed`, `model.task`,
        `model.num_negatives` (retrieval), `model.num_tasks` (ranking) and whether
        `data.num_contextual` asks for the contextual features (> 0) or not (0)."""
        d, m = cfg.data, cfg.model
        retrieval = m.task == "retrieval"
        return cls(
            task=m.task,
            max_history=d.max_history,
            min_history=d.min_history,
            num_candidates=d.max_candidates,
            num_negatives=m.num_negatives if retrieval else 0,
            num_tasks=None if retrieval else m.num_tasks,
            seed=d.seed,
            use_contextual=d.num_contextual > 0,
        )


class PreparedDataset:
    def __init__(self, path: Path | str, spec: PreparedSpec | None = None, *, verify=False):
        self.path = Path(path)
        self.spec = spec or PreparedSpec()
        self.manifest = Manifest.load(self.path)
        if verify:
            verify_checksums(self.path, self.manifest)
        arrays = open_arrays(self.path, self.manifest)
        self._offsets, self._num_train = arrays["offsets"], arrays["num_train"]
        self._item, self._action, self._time = arrays["item"], arrays["action"], arrays["time"]
        self._contextual = arrays["contextual"]
        m, s = self.manifest, self.spec
        if s.num_tasks is not None and s.num_tasks > len(m.task_names):
            raise HSTUError(
                f"num_tasks={s.num_tasks} but {m.dataset} has {len(m.task_names)} tasks "
                f"{m.task_names}"
            )
        self.seed = m.seed if s.seed is None else s.seed
        self.num_tasks = len(m.task_names) if s.num_tasks is None else s.num_tasks
        self.task_names = list(m.task_names[: self.num_tasks])  # the label bits kept, in order
        label_mask = (1 << self.num_tasks) - 1
        self._label_of_action = np.asarray(m.label_of_action, np.int64) & label_mask
        # Samples per user, and their running total: sample s belongs to the user u with
        # first[u] <= s < first[u + 1] (a binary search, so opening costs no per-sample work).
        train = np.asarray(self._num_train, dtype=np.int64)
        if s.task == "ranking":
            per_user = -(-np.maximum(train - s.min_history, 0) // s.num_candidates)
        else:
            per_user = -(-np.maximum(train - 1, 0) // (s.max_history - 1))
        self._first = np.zeros(len(train) + 1, dtype=np.int64)
        np.cumsum(per_user, out=self._first[1:])
        self._perm_cache: tuple[int, np.ndarray] | None = None

    # ------------------------------------------------------------------ sizes and ranges
    num_users = property(lambda self: self.manifest.num_users)
    num_items = property(lambda self: self.manifest.num_items)
    num_actions = property(lambda self: self.manifest.num_actions)
    num_contextual = property(
        lambda self: self.manifest.num_contextual if self.spec.use_contextual else 0
    )
    num_contextual_ids = property(lambda self: self.manifest.num_contextual_ids)

    @property
    def num_samples(self) -> int:
        """Training samples per epoch."""
        return int(self._first[-1])

    @property
    def jagged_keys(self) -> tuple[str, ...]:
        return HSTU_JAGGED_KEYS + (("negative",) if self.spec.num_negatives else ())

    def check_model(
        self, num_items: int, num_actions: int, num_contextual_ids: int, num_tasks: int
    ) -> None:
        """Raise naming each model setting that does not fit this dataset's ids and tasks."""
        m = self.manifest
        problems = [
            f"model.{name}={have} < {need} ({what})"
            for name, have, need, what in (
                ("num_items", num_items, m.num_items, "items"),
                ("num_actions", num_actions, m.num_actions, m.action_meaning),
                ("num_contextual_ids", num_contextual_ids, m.num_contextual_ids, "contextual ids"),
            )
            if have < need
        ]
        if num_tasks > len(m.task_names):
            tasks = f"{len(m.task_names)} tasks {m.task_names}"
            problems.append(f"model.num_tasks={num_tasks} > the dataset's {tasks}")
        if problems:
            raise HSTUError(
                f"the model does not fit {m.dataset} at {self.path}: " + "; ".join(problems)
            )

    # ------------------------------------------------------------------ training samples
    def permutation(self, epoch: int) -> np.ndarray:
        cached = self._perm_cache
        if cached is None or cached[0] != epoch:
            rng = np.random.default_rng([self.seed, _PERMUTATION, epoch])
            cached = (epoch, rng.permutation(self.num_samples))
            self._perm_cache = cached
        return cached[1]

    def sample_sizes(self) -> tuple[np.ndarray, np.ndarray]:
        """(history events, candidates) of every sample of an epoch, in window order (what
        `window` gives, vectorised): the length distribution that static-shape capacities are
        fitted to (`hstu.capacity.from_prepared`)."""
        s = self.spec
        per_user = np.diff(self._first)
        user = np.repeat(np.arange(len(per_user)), per_user)
        back = np.arange(self.num_samples) - self._first[user]
        train = np.asarray(self._num_train, dtype=np.int64)[user]
        if s.task == "ranking":
            end = train - back * s.num_candidates
            cand = np.maximum(end - s.num_candidates, s.min_history)
            return cand - np.maximum(cand - s.max_history, 0), end - cand
        end = train - back * (s.max_history - 1)
        return end - np.maximum(end - s.max_history, 0), np.zeros_like(end)

    def window(self, sample: int) -> tuple[int, int, int, int]:
        """(user, start, first_candidate, end): sample `sample` of an epoch is the user's
        events [start, end), candidates from `first_candidate` on (retrieval: none, = end)."""
        if not 0 <= sample < self.num_samples:
            raise HSTUError(f"sample {sample} outside [0, num_samples={self.num_samples})")
        s = self.spec
        user = int(np.searchsorted(self._first, sample, side="right")) - 1
        back = sample - int(self._first[user])  # 0: the most recent window of the user
        train = int(self._num_train[user])
        if s.task == "ranking":
            end = train - back * s.num_candidates
            cand = max(end - s.num_candidates, s.min_history)
            return user, max(cand - s.max_history, 0), cand, end
        end = train - back * (s.max_history - 1)
        return user, max(end - s.max_history, 0), end, end

    def sample(self, global_index: int) -> dict[str, np.ndarray]:
        if self.num_samples == 0:
            raise HSTUError(f"{self.path}: no training samples with {self.spec}")
        if global_index < 0:
            raise HSTUError(f"global index {global_index} must be >= 0")
        epoch, within = divmod(int(global_index), self.num_samples)
        user, start, cand, end = self.window(int(self.permutation(epoch)[within]))
        base = int(self._offsets[user])
        out = self._events(user, base + start, base + cand, base + end)
        out["sample_id"] = int(global_index)
        if self.spec.num_negatives:
            rng = np.random.default_rng([self.seed, _NEGATIVES, int(global_index)])
            size = max(len(out["item"]) - 1, 0) * self.spec.num_negatives
            out["negative"] = rng.integers(0, self.num_items, size=size, dtype=np.int64)
        return out

    def _events(self, user: int, lo: int, mid: int, hi: int) -> dict[str, np.ndarray]:
        """History = rows [lo, mid), candidates = rows [mid, hi) of the flat arrays (copied
        out of the read-only memory maps, widened to int64 like every batch value)."""
        action = np.array(self._action[lo:hi], dtype=np.int64)
        contextual = self._contextual[user] if self.spec.use_contextual else ()
        return {
            "contextual": np.array(contextual, dtype=np.int64),
            "item": np.array(self._item[lo:mid], dtype=np.int64),
            "action": action[: mid - lo],
            "item_time": np.array(self._time[lo:mid], dtype=np.int64),
            "candidate": np.array(self._item[mid:hi], dtype=np.int64),
            "candidate_time": np.array(self._time[mid:hi], dtype=np.int64),
            "label": self._label_of_action[action[mid - lo :]],
        }

    def train_events(self) -> dict[str, np.ndarray]:
        """Every train-split event as flat arrays `user`, `item`, `label` (for baselines and
        statistics; reads the whole item and action arrays)."""
        offsets = np.asarray(self._offsets)
        user = np.repeat(np.arange(self.num_users), np.diff(offsets))
        in_train = np.arange(offsets[-1]) - offsets[user] < np.asarray(self._num_train)[user]
        action = np.asarray(self._action)[in_train]
        return {
            "user": user[in_train],
            "item": np.asarray(self._item, dtype=np.int64)[in_train],
            "label": self._label_of_action[action],
        }

    # ------------------------------------------------------------------ evaluation
    def eval_users(self, split: str) -> np.ndarray:
        """Users with a held-out event in `split` (every user with >= 3 events)."""
        if split not in SPLITS:
            raise HSTUError(f"split={split!r} must be one of {list(SPLITS)}")
        lengths = np.diff(np.asarray(self._offsets))
        return np.flatnonzero(lengths - np.asarray(self._num_train) == 2)

    def eval_sample(self, split: str, user: int, num_negatives: int = 0) -> dict[str, np.ndarray]:
        """The user's held-out event of `split` as a one-candidate sample.

        The history is every event before it (truncated to the last `max_history`; for "test"
        it includes the validation event), `target` is the held-out item (also `candidate[0]`,
        labelled like a ranking candidate) and `seen` the sorted distinct items of the whole
        history before the target (for filtering; it may contain the target on datasets with
        repeats, which metrics never filter). `sample_id` is the user. With `num_negatives`,
        `negatives` holds that many distinct items the user never interacted with before the
        target (SASRec protocol), from a generator seeded by (seed, split, user).
        """
        if split not in SPLITS:
            raise HSTUError(f"split={split!r} must be one of {list(SPLITS)}")
        user = int(user)
        base, end = int(self._offsets[user]), int(self._offsets[user + 1])
        if end - base - int(self._num_train[user]) != 2:
            raise HSTUError(f"user {user} has no held-out events (fewer than 3 events)")
        target = end - (2 if split == "valid" else 1)
        out = self._events(user, max(target - self.spec.max_history, base), target, target + 1)
        out["sample_id"] = int(user)
        out["user"] = int(user)
        out["target"] = int(self._item[target])
        out["seen"] = np.unique(np.asarray(self._item[base:target], dtype=np.int64))
        if num_negatives:
            from hstu.evaluation import sample_unseen

            rng = np.random.default_rng([self.seed, _EVAL_NEGATIVES, SPLITS.index(split), user])
            seen, target = out["seen"], out["target"]
            out["negatives"] = sample_unseen(rng, self.num_items, seen, target, num_negatives)
        return out

    def eval_samples(
        self, split: str, max_users: int | None = None, num_negatives: int = 0
    ) -> Iterator[dict]:
        """`eval_sample` of each evaluation user in id order (the first `max_users` if given)."""
        for user in self.eval_users(split)[:max_users]:
            yield self.eval_sample(split, int(user), num_negatives)
