"""training.cdk.config: Config() is the cpu preset, presets are differences from it, the
paper preset is the paper's setting alone, the command line follows training.cli, and a
config of other code is refused."""

import dataclasses

import pytest

from training.cdk.config import (
    PRESETS,
    Config,
    from_dict,
    input_size,
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
    # the preset is Config() with the native input size resolved (sketches' too)
    native = dataclasses.replace(Config(), image_size=240, sketch_image_size=240)
    assert make_config("cpu") == native
    assert make_config() == native and Config().preset == "cpu"
    c = Config()
    assert (c.modes, c.hidden, c.batch_size, c.epochs, c.lr, c.k) == (256, 1024, 512, 200, 0.05, 10)
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
    assert (p.modes, p.hidden, p.batch_size, p.epochs, p.lr, p.mu, p.momentum, p.k) == \
        (512, 8192, 4096, 10, 5e-3, 16.0, 0.9, 100)
    assert p.nesting_weights == "uniform" and p.grad_clip > 0 and p.preset == "paper"
    for method in ("neuralsvd-seq", "lora"):  # the paper's lr for every method
        assert make_config("paper", method=method).lr == 5e-3
    # the paper's setting and nothing else: pretrained VGG16 features as the heads' input,
    # none of the product's additions
    assert (p.backbone, p.finetune, p.pooling, p.weight_decay, p.momentum) == (
        "vgg16", False, "avg", 0.0, 0.9)
    assert (p.smooth_k, p.raw_dims, p.input_dropout) == (0, 0, 0.0)
    assert not (p.unit_embeddings or p.sort_modes or p.photo_flip_average
                or p.sketch_flip_average)


def test_a_preset_that_does_not_fit_the_data_is_named():
    from training.cdk.config import fit_warnings

    # sketchy-mini split 2: 2,350 training sketches
    [line] = fit_warnings(make_config("paper"), 2350)
    assert "preset paper (batch 4096, 10 epochs) does not fit these data" in line
    assert "1 step(s) an epoch, 10 in all" in line and "--preset cpu" in line
    assert fit_warnings(make_config("cpu"), 2350) == []  # 4 steps an epoch, 800 in all
    assert fit_warnings(make_config("paper"), 60_000) == []  # full Sketchy: 140 steps


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
    assert (cfg.modes, cfg.hidden, cfg.batch_size, cfg.epochs, cfg.lr, cfg.mu) == \
        (512, 8192, 4096, 10, 5e-3, 16.0)
    assert cfg.momentum == 0.9 and cfg.grad_clip > 0 and cfg.seed == 3 and cfg.k == 100
    # fine-tuning takes no mirror-averaged features and no raw coordinates
    flip = ["--photo-flip-average", "false", "--raw-dims", "0"]
    assert parse_args(["--data", "d", "--finetune", "true", *flip]).finetune is True
    assert parse_args(["--data", "d", "--finetune", *flip]).finetune is True
    assert parse_args(["--data", "d", "--batch-size", "64", "--backbone-lr", "0.01",
                       "--cache-dir", "c"]) == make_config(data="d", batch_size=64,
                                                           backbone_lr=0.01, cache_dir="c")
    for bad in (["--data", "d", "--nosuchflag", "1"], ["--data", "d", "--method", "pca"],
                ["--data", "d", "--preset", "gpu"], ["--data", "d", "--epochs", "two"],
                ["--data", "d", "--backbone", "resnet"], ["--split", "sketchy2"],
                ["--data", "d", "--modes", "0"], ["--data", "nodir"],
                ["--data", "d", "--L", "8"],  # the number of modes is --modes
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
    assert "default: 256" in out and "paper: modes=512" in out


def test_from_dict_round_trips_and_refuses_configs_of_other_code():
    cfg = make_config("paper", method="lora", seed=2)
    assert from_dict(to_dict(cfg)) == cfg
    assert from_dict({**to_dict(cfg), "untrained": True}) == cfg  # extra keys: ignored
    # a checkpoint from before the share of instance pairs was trained on the class kernel
    default = make_config()
    earlier = {k: v for k, v in to_dict(default).items() if k != "instance_share"}
    assert from_dict(earlier).instance_share == 0.0 and default.instance_share == 0.5
    # a checkpoint from before whitening stored plain principal axes
    earlier = {k: v for k, v in to_dict(default).items() if k != "raw_whiten"}
    assert from_dict(earlier).raw_whiten == 0.0 and default.raw_whiten == 0.5
    # a checkpoint from before the sketches' own size embedded them at image_size
    earlier = {k: v for k, v in to_dict(default).items() if k != "sketch_image_size"}
    assert from_dict(earlier).sketch_image_size == 0
    assert input_size(from_dict(earlier), "sketch") == default.image_size == 240
    # query expansion trains nothing: a checkpoint from before it gets today's
    earlier = {k: v for k, v in to_dict(default).items() if not k.startswith("expand_")}
    assert (from_dict(earlier).expand_n, from_dict(earlier).expand_weight) == (5, 0.5)
    old = {k: v for k, v in to_dict(cfg).items() if k != "modes"}
    with pytest.raises(ValueError, match=r"ck.pt lacks the config fields \['modes'\].*retrain"):
        from_dict({**old, "L": 512}, "ck.pt")


def test_input_dropout_values():
    assert Config().input_dropout == 0.3 and make_config("paper").input_dropout == 0.0
    assert make_config(input_dropout=0.0).input_dropout == 0.0
    for bad in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match="input_dropout must be in"):
            make_config(input_dropout=bad)


def test_mirror_averaging_is_chosen_per_modality():
    assert Config().photo_flip_average and not Config().sketch_flip_average
    both = make_config(sketch_flip_average=True)
    assert both.photo_flip_average and both.sketch_flip_average
    sketches = make_config(photo_flip_average=False, sketch_flip_average=True)
    assert not sketches.photo_flip_average and sketches.sketch_flip_average
    with pytest.raises(ValueError, match="sketch_flip_average applies to frozen backbones"):
        make_config(finetune=True, photo_flip_average=False, sketch_flip_average=True,
                    raw_dims=0)


def test_sketch_image_size_values():
    assert Config().sketch_image_size == 0  # resolved by make_config
    assert make_config().sketch_image_size == make_config().image_size == 240
    assert make_config(image_size=200).sketch_image_size == 200
    c = make_config(sketch_image_size=160)
    assert (c.image_size, c.sketch_image_size) == (240, 160)
    assert (input_size(c, "sketch"), input_size(c, "photo")) == (160, 240)
    with pytest.raises(ValueError, match="sketch_image_size must be >= 0"):
        make_config(sketch_image_size=-1)
    frozen = {"photo_flip_average": False, "raw_dims": 0}
    with pytest.raises(ValueError, match="sketch_image_size 160 other than image_size 240 "
                                         "applies to frozen backbones"):
        make_config(finetune=True, sketch_image_size=160, **frozen)
    assert make_config(finetune=True, sketch_image_size=240, **frozen).sketch_image_size == 240


def test_unit_embeddings_values():
    assert Config().unit_embeddings is True and make_config("paper").unit_embeddings is False
    assert make_config(unit_embeddings=False, raw_dims=0).unit_embeddings is False


def test_raw_coordinates_values():
    assert (Config().raw_dims, Config().raw_weight, Config().raw_whiten) == (256, 2.0, 0.5)
    assert make_config("paper").raw_dims == 0
    with pytest.raises(ValueError, match="needs --unit-embeddings true"):
        make_config(unit_embeddings=False)
    with pytest.raises(ValueError, match="raw_dims applies to frozen backbones"):
        make_config(finetune=True, photo_flip_average=False)
    with pytest.raises(ValueError, match="raw_weight must be positive"):
        make_config(raw_weight=0.0)
    with pytest.raises(ValueError, match="raw_dims must be >= 0"):
        make_config(raw_dims=-1)
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="raw_whiten must be in"):
            make_config(raw_whiten=bad)


def test_query_expansion_values():
    from training.cdk.config import RUNTIME_FIELDS, expansion

    assert expansion(make_config()).as_dict() == {"n": 5, "weight": 0.5}
    assert not expansion(make_config("paper")).active  # the paper's setting: none
    assert {"expand_n", "expand_weight"} <= set(RUNTIME_FIELDS)  # a run resumes with others
    for bad in ({"expand_n": -1}, {"expand_weight": -0.5}):
        with pytest.raises(ValueError, match="query expansion"):
            make_config(**bad)
