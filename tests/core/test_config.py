import pytest
import yaml

from hstu.config import Config, config_from_dict, load_config
from hstu.errors import HSTUError
from hstu.testing import DEMO_CONFIG


def test_demo_recipe_loads_and_round_trips(tmp_path):
    cfg = load_config(DEMO_CONFIG)
    assert cfg.dist.world_size == 4 and cfg.balance.shuffler == "balanced"
    cfg.save(tmp_path / "config.yaml")
    again = config_from_dict(yaml.safe_load((tmp_path / "config.yaml").read_text()))
    assert again == cfg


def test_overrides_are_typed():
    cfg = load_config(
        DEMO_CONFIG,
        [
            "train.steps=3",
            "data.seqlen_dist=zipf",
            "model.alpha=0.5",
            "balance.exchange=all2all",
            "data.seqlen_params={a: 1.5}",
        ],
    )
    assert cfg.train.steps == 3 and cfg.data.seqlen_dist == "zipf"
    assert cfg.model.alpha == 0.5 and cfg.balance.exchange == "all2all"
    assert cfg.data.seqlen_params == {"a": 1.5}
    assert load_config(None, ["model.normalizer=64"]).model.normalizer == 64.0


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.stepz=3", "unknown key 'train.stepz'"),
        ("nope=1", "unknown key 'nope'"),
        ("train.steps=three", "train.steps expects an integer"),
        ("train.steps=0", "train.steps=0"),
        ("balance.shuffler=random", "balance.shuffler"),
        ("data.seqlen_dist=bimodal", "data.seqlen_dist"),
        ("model.dropout=1.5", "model.dropout"),
        ("model.pallas_lowering=cutlass", "model.pallas_lowering"),
        ("dist.world_size=-1", "dist.world_size"),
        ("train=3", "'train' is a section"),
        ("steps", "key.sub=value"),
    ],
)
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(HSTUError, match=message.replace("(", r"\(")):
        load_config(DEMO_CONFIG, [override])


def test_unknown_key_in_yaml(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model:\n  embeding_dim: 3\n")
    with pytest.raises(HSTUError, match="model.embeding_dim"):
        load_config(p)


def test_missing_file():
    with pytest.raises(HSTUError, match="does not exist"):
        load_config("configs/missing.yaml")


def test_defaults_validate():
    assert Config().validate().model.resolved_alpha == pytest.approx(32**-0.5)


def test_attention_names_map_to_each_backends_kernel():
    cfg = load_config(DEMO_CONFIG, ["model.attention=triton"])
    assert cfg.model.attention_impl("torch") == "kernel"
    with pytest.raises(HSTUError, match="other backend's kernel"):
        cfg.model.attention_impl("jax")
    cfg = load_config(DEMO_CONFIG, ["model.attention=pallas"])
    assert cfg.model.attention_impl("jax") == "kernel"
    assert load_config(DEMO_CONFIG).model.attention_impl("jax") == "reference"


@pytest.mark.parametrize("text", ["1e-3", "1E-3", "0.001", ".001", "1_0e-4", " 1e-3"])
def test_every_float_spelling_python_accepts(text, tmp_path):
    assert load_config(DEMO_CONFIG, [f"train.lr={text}"]).train.lr == pytest.approx(1e-3)
    p = tmp_path / "lr.yaml"
    p.write_text(f"train:\n  lr: {text.strip()}\n")  # YAML reads 1e-3 (no dot) as a string
    assert load_config(p).train.lr == pytest.approx(1e-3)


@pytest.mark.parametrize("text", ["inf", "nan", "1e-3x", "[1]"])
def test_a_float_that_is_no_finite_number_is_an_error(text):
    with pytest.raises(HSTUError, match="train.lr"):
        load_config(DEMO_CONFIG, [f"train.lr={text}"])


def test_seqlen_params_keys_are_checked_against_the_distribution():
    with pytest.raises(HSTUError, match=r"seqlen_params.sigmaa.*accepted: \['sigma', 'median'\]"):
        load_config(DEMO_CONFIG, ["data.seqlen_params={sigmaa: 9}"])
    with pytest.raises(HSTUError, match="seqlen_params.a expects a number"):
        load_config(DEMO_CONFIG, ["data.seqlen_dist=zipf", "data.seqlen_params={a: x}"])
    with pytest.raises(HSTUError, match="seqlen_params.sigma=-1"):
        load_config(DEMO_CONFIG, ["data.seqlen_params={sigma: -1}"])
    with pytest.raises(HSTUError, match="accepted: none"):
        load_config(DEMO_CONFIG, ["data.seqlen_dist=fixed"])  # demo's {sigma: 1.2} is stale
    cfg = load_config(DEMO_CONFIG, ["data.seqlen_dist=fixed", "data.seqlen_params={}"])
    assert cfg.data.seqlen_params == {}


def test_invalid_yaml_is_a_clear_error(tmp_path):
    p = tmp_path / "broken.yaml"
    p.write_text("model:\n  embedding_dim: [1,\n")
    with pytest.raises(HSTUError, match="not valid YAML"):
        load_config(p)
    with pytest.raises(HSTUError, match="not valid YAML"):
        load_config(None, ["model.embedding_dim=[1,"])


def test_every_key_has_a_type_default_and_description():
    from hstu.config import describe, format_keys

    keys = describe()
    assert len(keys) > 40
    for k in keys:
        assert k.doc and k.type, k
    table = format_keys(load_config(DEMO_CONFIG, ["train.lr=3e-4"]))
    assert "train.lr" in table and "AdamW learning rate" in table
    line = next(x for x in table.splitlines() if x.startswith("train.lr "))
    assert "0.0003" in line and "*" in line  # differs from the default


def test_packaged_recipes_load_by_name_from_any_directory(tmp_path):
    import subprocess
    import sys

    from hstu.config import recipe_names

    assert {"demo", "gpu", "bench_upstream"} <= set(recipe_names())
    assert load_config("demo") == load_config(DEMO_CONFIG)
    out = subprocess.run(
        [sys.executable, "-m", "hstu.cli", "config", "show", "--config", "demo"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "dist.world_size" in out
    with pytest.raises(HSTUError, match=r"no recipe named 'dmeo'.*'demo'"):
        load_config("dmeo")


def test_sharded_tables_refuse_what_they_cannot_do():
    """Before anything starts, the same in both backends: weight decay with row-wise
    Adagrad. Probes time sharded tables from their looked-up rows (both backends)."""
    cases = {
        "embedding.weight_decay": ["embedding.sharding=auto", "embedding.weight_decay=0.1"],
    }
    for key, overrides in cases.items():
        with pytest.raises(HSTUError, match=f"config: {key}="):
            load_config(DEMO_CONFIG, overrides)
    for sharding in ("none", "row_wise", "data_parallel"):
        load_config(DEMO_CONFIG, [f"embedding.sharding={sharding}", "bench.probe_every=3"])
    # replicated tables take Adam on the rows the ranks touched (their marks combined)
    load_config(DEMO_CONFIG, ["embedding.sharding=data_parallel", "embedding.optimizer=adam"])
