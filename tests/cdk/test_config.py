"""training.cdk.config: Config() is the cpu preset, presets are differences from it, the
command line follows training.cli, and older checkpoints' configs still load."""

import dataclasses

import pytest

from training.cdk.config import (
    PRESETS,
    Config,
    from_dict,
    make_config,
    parse_args,
    to_dict,
)


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d").mkdir()
    return "d"


def test_defaults_are_the_cpu_preset():
    # the preset is Config() with the native input size resolved
    native = dataclasses.replace(Config(), image_size=240)
    assert make_config("cpu") == native
    assert make_config() == native and Config().preset == "cpu"
    c = Config()
    assert (c.L, c.hidden, c.batch_size, c.epochs, c.lr, c.k) == (256, 1024, 512, 200, 0.05, 10)
    assert (c.backbone, c.image_size, c.weight_decay) == ("efficientnet-lite1", 0, 5e-3)
    assert (c.method, c.nesting_weights, c.mu, c.grad_clip) == ("neuralsvd-jnt", "harmonic",
                                                                16.0, 1.0)


def test_presets_name_only_existing_fields():
    names = {f.name for f in dataclasses.fields(Config)}
    for preset, table in PRESETS.items():
        for key, value in table.items():
            assert key in names or key in ("neuralsvd-jnt", "neuralsvd-seq", "lora"), key
            if isinstance(value, dict):
                assert set(value) <= names, (preset, key)


def test_paper_preset():
    p = make_config("paper")
    assert (p.L, p.hidden, p.batch_size, p.epochs, p.lr, p.mu, p.momentum, p.k) == \
        (512, 8192, 4096, 10, 5e-3, 16.0, 0.9, 100)
    assert p.nesting_weights == "uniform" and p.grad_clip > 0 and p.preset == "paper"
    for method in ("neuralsvd-seq", "lora"):  # the paper's lr for every method
        assert make_config("paper", method=method).lr == 5e-3


def test_method_values_of_the_cpu_preset():
    # Sequential nesting diverges at the cpu preset's lr 0.05: 0.005, unless the user sets one.
    seq = make_config(method="neuralsvd-seq")
    assert (seq.lr, seq.nesting_weights) == (0.005, "uniform")
    assert make_config(method="neuralsvd-seq", lr=0.1).lr == 0.1
    lora = make_config(method="lora")
    assert (lora.lr, lora.nesting_weights) == (0.05, "uniform")
    # Joint nesting: harmonic weights in the cpu preset, the paper's uniform ones on request.
    assert make_config(nesting_weights="uniform").nesting_weights == "uniform"
    with pytest.raises(ValueError, match="applies to neuralsvd-jnt only, not 'lora'"):
        make_config(method="lora", nesting_weights="harmonic")


def test_make_config_rejects_unknown_fields_and_wrong_types():
    with pytest.raises(ValueError, match="unknown config field 'batch'"):
        make_config(batch=8)
    with pytest.raises(ValueError, match="epochs must be of type int, got '3'"):
        make_config(epochs="3")
    with pytest.raises(ValueError, match="preset must be one of"):
        make_config("gpu")


def test_cli_parsing_rules(data_dir):
    cfg = parse_args(["--data", "d", "--preset", "paper", "--seed", "3"])
    assert (cfg.L, cfg.hidden, cfg.batch_size, cfg.epochs, cfg.lr, cfg.mu) == \
        (512, 8192, 4096, 10, 5e-3, 16.0)
    assert cfg.momentum == 0.9 and cfg.grad_clip > 0 and cfg.seed == 3 and cfg.k == 100
    # fine-tuning takes no mirror-averaged features and no raw coordinates
    flip = ["--flip-average", "false", "--raw-dims", "0"]
    assert parse_args(["--data", "d", "--finetune", "true", *flip]).finetune is True
    assert parse_args(["--data", "d", "--finetune", *flip]).finetune is True
    assert parse_args(["--data", "d", "--batch-size", "64", "--backbone-lr", "0.01",
                       "--cache-dir", "c"]) == make_config(data="d", batch_size=64,
                                                           backbone_lr=0.01, cache_dir="c")
    for bad in (["--data", "d", "--nosuchflag", "1"], ["--data", "d", "--method", "pca"],
                ["--data", "d", "--preset", "gpu"], ["--data", "d", "--epochs", "two"],
                ["--data", "d", "--backbone", "resnet"], ["--split", "sketchy2"],
                ["--data", "d", "--L", "0"], ["--data", "nodir"],
                ["--data", "d", "--split", "sketchy3"],
                ["--data", "d", "--batch_size", "64"],  # the old underscore flags are gone
                ["--data", "d", "--nesting-weights", "linear"],
                ["--data", "d", "--method", "lora", "--nesting-weights", "harmonic"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    assert parse_args(["--data", "d", "--nesting-weights", "uniform"]).nesting_weights == \
        "uniform"
    # The preset's values for the method, unless the user sets them; no need to pass
    # --nesting-weights uniform with a method that does not nest jointly.
    assert parse_args(["--data", "d", "--method", "neuralsvd-seq"]).lr == 0.005
    assert parse_args(["--data", "d", "--method", "neuralsvd-seq", "--lr", "0.1"]).lr == 0.1
    assert parse_args(["--data", "d", "--method", "lora"]).lr == 0.05
    assert parse_args(["--data", "d"]).nesting_weights == "harmonic"
    assert parse_args(["--data", "d", "--preset", "paper"]).nesting_weights == "uniform"


def test_help_lists_every_field(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    for f in dataclasses.fields(Config):
        assert "--" + f.name.replace("_", "-") in out
    assert "default: 256" in out and "paper: L=512" in out


def test_from_dict_loads_older_checkpoints():
    cfg = make_config("paper", method="lora", seed=2)
    assert from_dict(to_dict(cfg)) == cfg
    # A checkpoint written before nesting_weights existed was trained with uniform weights
    # (today's default is the cpu preset's harmonic); keys that are no field are ignored.
    old = {k: v for k, v in to_dict(make_config(nesting_weights="uniform")).items()
           if k not in ("nesting_weights", "pairing")}
    loaded = from_dict({**old, "untrained": True})
    assert loaded.nesting_weights == "uniform" and loaded.pairing == "class"
    assert loaded == make_config(nesting_weights="uniform")


def test_input_dropout_values():
    assert Config().input_dropout == 0.3 and make_config("paper").input_dropout == 0.0
    assert make_config(input_dropout=0.0).input_dropout == 0.0
    for bad in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match="input_dropout must be in"):
            make_config(input_dropout=bad)
    # heads of checkpoints written before the field existed were trained without it
    old = {k: v for k, v in to_dict(make_config()).items() if k != "input_dropout"}
    assert from_dict(old).input_dropout == 0.0


def test_sketch_mirror_averaging_is_a_choice_on_top_of_the_photos():
    from training.cdk.config import sketch_flip_average

    assert not sketch_flip_average(Config()) and Config().flip_average
    assert sketch_flip_average(make_config(flip_average_sketches=True))
    with pytest.raises(ValueError, match="needs --flip-average true"):
        make_config(flip_average=False, flip_average_sketches=True)
    # checkpoints of earlier code averaged sketches whenever they averaged photos
    old = {k: v for k, v in to_dict(make_config()).items() if k != "flip_average_sketches"}
    assert sketch_flip_average(from_dict(old))


def test_unit_embeddings_values():
    assert Config().unit_embeddings is True and make_config("paper").unit_embeddings is False
    assert make_config(unit_embeddings=False, raw_dims=0).unit_embeddings is False
    # checkpoints of earlier code used the heads' outputs as they are
    old = {k: v for k, v in to_dict(make_config()).items()
           if k not in ("unit_embeddings", "raw_dims")}
    assert from_dict(old).unit_embeddings is False


def test_raw_coordinates_values():
    assert Config().raw_dims == 256 and Config().raw_weight == 1.0
    assert make_config("paper").raw_dims == 0
    old = {k: v for k, v in to_dict(make_config()).items()
           if k not in ("unit_embeddings", "raw_dims", "raw_weight")}
    assert from_dict(old).raw_dims == 0  # checkpoints of earlier code had none
    with pytest.raises(ValueError, match="needs --unit-embeddings true"):
        make_config(unit_embeddings=False)
    with pytest.raises(ValueError, match="raw_dims applies to frozen backbones"):
        make_config(finetune=True, flip_average=False)
    with pytest.raises(ValueError, match="raw_weight must be positive"):
        make_config(raw_weight=0.0)
    with pytest.raises(ValueError, match="raw_dims must be >= 0"):
        make_config(raw_dims=-1)
