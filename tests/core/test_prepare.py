"""prepare -> load round trips on publisher-format files with planted structure."""

import json

import numpy as np
import pytest

from hstu.data.manifest import Manifest, verify_checksums
from hstu.data.prepare import DATASETS, main, prepare
from hstu.data.prepared import PreparedDataset
from hstu.errors import HSTUError
from hstu.testing_data import PlantedSpec, movie_id, planted_events, user_id, write_dataset

SPEC = PlantedSpec()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("prepared")
    out = {}
    for name in DATASETS:
        src = write_dataset(name, root / name / "src", SPEC)
        out[name] = (src, root / name / "out", prepare(name, src, root / name / "out"))
    return out


def expected_actions(name, ev):
    if name == "ml-1m":
        return 2 * ev.stars - 1
    if name == "seq-txt":
        return np.zeros_like(ev.stars)
    return None  # ml-20m / kuairand: random noise on top of the stars, checked by range


@pytest.mark.parametrize("name", DATASETS)
def test_round_trip_counts_mapping_and_sequences(prepared, name):
    _, out, m = prepared[name]
    ev = planted_events(SPEC)
    lengths = np.bincount(ev.user)
    assert (m.dataset, m.num_users, m.num_events) == (name, SPEC.num_users, len(ev.user))
    assert m.num_items == len(np.unique(ev.item))
    held = lengths >= 3
    assert m.num_events_per_split == {
        "train": int(np.where(held, lengths - 2, lengths).sum()),
        "valid": int(held.sum()),
        "test": int(held.sum()),
    }
    assert m.max_sequence_length == lengths.max()
    ds = PreparedDataset(out, verify=True)
    arrays = {k: np.asarray(getattr(ds, f"_{k}")) for k in ("offsets", "item", "action", "time")}
    item_raw = np.load(out / "item_raw_id.npy")
    np.testing.assert_array_equal(np.load(out / "user_raw_id.npy"), user_id(np.arange(150)))
    np.testing.assert_array_equal(item_raw, movie_id(np.unique(ev.item)))
    # Planted events are in (user, time) order, as the prepared sequences must be.
    np.testing.assert_array_equal(item_raw[arrays["item"]], movie_id(ev.item))
    np.testing.assert_array_equal(arrays["offsets"][1:], np.cumsum(lengths))
    want_actions = expected_actions(name, ev)
    if want_actions is not None:
        np.testing.assert_array_equal(arrays["action"], want_actions)
    assert arrays["action"].max() < m.num_actions
    dt = np.diff(arrays["time"])
    first = np.zeros(len(dt) + 1, dtype=bool)
    first[arrays["offsets"][:-1]] = True
    assert (dt[~first[1:]] >= 0).all()  # time order within every user
    if name in ("ml-1m", "ml-20m"):
        np.testing.assert_array_equal(arrays["time"], ev.time)


def test_contextual_features(prepared):
    m1 = prepared["ml-1m"][2]
    assert m1.contextual_names == ["gender", "age", "occupation", "zip3"]
    ctx = np.load(prepared["ml-1m"][1] / "contextual.npy")
    assert ctx.shape == (150, 4) and ctx.max() < m1.num_contextual_ids
    assert len(np.unique(ctx[:, 0])) == 2  # M / F, offset 0
    assert len(np.unique(ctx[:, 1])) == 7 and ctx[:, 1].min() == 2  # ages after 2 genders
    mk = prepared["kuairand-pure"][2]
    assert mk.num_contextual == 8 and mk.contextual_names[0] == "user_active_degree"
    assert prepared["ml-20m"][2].num_contextual == 0


def test_kuairand_times_and_labels(prepared):
    _, out, m = prepared["kuairand-1k"]
    assert m.task_names[:2] == ["is_click", "long_view"] and m.num_actions == 256
    assert [s["name"] for s in m.sources] == [
        "log_standard_4_08_to_4_21_1k.csv",
        "log_standard_4_22_to_5_08_1k.csv",
        "user_features_1k.csv",
        "video_features_basic_1k.csv",
    ]
    ev = planted_events(SPEC)
    time = np.load(out / "time.npy")
    np.testing.assert_array_equal(time - time.min(), ev.time - ev.time.min())
    action = np.load(out / "action.npy")
    assert ((action & 2) <= (action & 1) * 2).all()  # long view only after a click (planted)


def test_manifest_checksum_determinism_and_corruption(prepared, tmp_path):
    src, out, m = prepared["ml-1m"]
    again = prepare("ml-1m", src, tmp_path / "again", seed=5)
    assert again.checksum == m.checksum and again.arrays == m.arrays and again.seed == 5
    assert Manifest.load(out) == m
    sources = {s["name"]: s["bytes"] for s in m.sources}
    assert sources["ratings.dat"] == (src / "ratings.dat").stat().st_size
    verify_checksums(tmp_path / "again")
    item = np.load(tmp_path / "again" / "item.npy")
    item[3] += 1
    np.save(tmp_path / "again" / "item.npy", item)
    with pytest.raises(HSTUError, match="item.npy: checksum mismatch"):
        PreparedDataset(tmp_path / "again", verify=True)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["split_rule"].startswith("leave-one-out")


def test_short_users_stay_in_train_and_min_user_events_drops(tmp_path):
    # users 5, 6, 7, 8 with 1, 2, 3, 4 events; equal timestamps keep file order
    lines = ["5 50 10", "6 60 10", "6 61 10", "7 70 1", "7 71 2", "7 72 2", "8 80 1"]
    lines += ["8 81 2", "8 82 3", "8 83 4"]
    (tmp_path / "s.txt").write_text("\n".join(lines) + "\n")
    m = prepare("seq-txt", tmp_path / "s.txt", tmp_path / "a")
    np.testing.assert_array_equal(np.load(tmp_path / "a" / "num_train.npy"), [1, 2, 1, 2])
    assert m.num_events_per_split == {"train": 6, "valid": 2, "test": 2}
    assert m.num_eval_users == 2
    items = np.load(tmp_path / "a" / "item_raw_id.npy")[np.load(tmp_path / "a" / "item.npy")]
    np.testing.assert_array_equal(items, [50, 60, 61, 70, 71, 72, 80, 81, 82, 83])
    m = prepare("seq-txt", tmp_path / "s.txt", tmp_path / "b", min_user_events=3)
    assert (m.num_users, m.num_dropped_users, m.num_items) == (2, 2, 7)


def test_seq_txt_without_timestamps_uses_positions(tmp_path):
    (tmp_path / "s.txt").write_text("1\t5\n2\t9\n1\t3\n1\t5\n")
    prepare("seq-txt", tmp_path, tmp_path / "out")
    np.testing.assert_array_equal(np.load(tmp_path / "out" / "time.npy"), [0, 1, 2, 0])
    raw = np.load(tmp_path / "out" / "item_raw_id.npy")[np.load(tmp_path / "out" / "item.npy")]
    np.testing.assert_array_equal(raw, [5, 3, 5, 9])


def test_output_directory_rules(prepared, tmp_path):
    src = prepared["seq-txt"][0]
    out = tmp_path / "out"
    prepare("seq-txt", src, out)
    with pytest.raises(HSTUError, match="not empty; pass overwrite=True"):
        prepare("seq-txt", src, out)
    prepare("seq-txt", src, out, overwrite=True)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(HSTUError, match="files that prepare did not write"):
        prepare("seq-txt", src, out, overwrite=True)
    (out / "manifest.json").unlink()
    with pytest.raises(HSTUError, match="no manifest.json"):
        PreparedDataset(out)
    with pytest.raises(HSTUError, match="dataset='ml-100k' must be one of"):
        prepare("ml-100k", src, tmp_path / "x")


def test_main(prepared, tmp_path, capsys):
    src = prepared["ml-20m"][0]
    argv = ["--dataset", "ml-20m", "--src", str(src), "--out", str(tmp_path / "o")]
    assert main(argv) == 0
    assert "ml-20m: 150 users" in capsys.readouterr().out
    assert main(argv) == 2
    assert "not empty" in capsys.readouterr().err
    assert main([*argv, "--overwrite", "--min-user-events", "30"]) == 0
