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
