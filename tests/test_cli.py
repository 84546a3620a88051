"""training.cli: flags from a frozen dataclass, presets then flags, errors that name the
bad flag or value."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Literal

import pytest
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from training import cli


@dataclass(frozen=True)
class Toy:
    name: str = ""
    batch_size: int = 8
    lr: float = 0.1
    dims: int | None = None
    finetune: bool = False
    progress: bool = True
    mode: str = "a"
    preset: str = "small"  # the record of the preset, not a flag of its own


PRESETS = {"small": {}, "big": {"batch_size": 64, "lr": 0.01}}


def make_toy(preset: str = "small", **flags) -> Toy:
    return cli.build(Toy, PRESETS[preset], flags, {"preset": preset})


def parser(**kw):
    return cli.build_parser(Toy, prog="toy", presets=PRESETS, default_preset="small",
                            choices={"mode": ["a", "b"]}, **kw)


def toy(argv, **kw) -> Toy:
    return cli.parse(parser(**kw), make_toy, argv)


def error_of(argv, capsys, **kw) -> str:
    with pytest.raises(SystemExit) as e:
        toy(argv, **kw)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_defaults_and_dashed_flags():
    assert toy([]) == Toy()
    cfg = toy(["--batch-size", "16", "--lr", "3e-4", "--dims", "4", "--name", "x"])
    assert (cfg.batch_size, cfg.lr, cfg.dims, cfg.name) == (16, 3e-4, 4, "x")
    assert isinstance(cfg.lr, float) and cfg.dims == 4


@pytest.mark.parametrize("argv,message", [
    (["--nosuch", "1"], "unrecognized arguments: --nosuch 1"),
    (["--batch_size", "16"], "unrecognized arguments: --batch_size"),  # dashed only
    (["--batch", "16"], "unrecognized arguments: --batch"),  # no abbreviations
    (["--preset", "huge"], "invalid choice: 'huge'"),
    (["--mode", "c"], "invalid choice: 'c'"),
    (["--batch-size", "two"], "argument --batch-size: invalid int value: 'two'"),
    (["--lr", "fast"], "argument --lr: invalid float value: 'fast'"),
    (["--dims", "1.5"], "argument --dims: invalid int value: '1.5'"),
    (["--finetune", "maybe"], "argument --finetune: expected one of"),
])
def test_unknown_flags_and_wrong_types_are_usage_errors(argv, message, capsys):
    assert message in error_of(argv, capsys)


def test_bool_flags():
    for text, value in [("true", True), ("1", True), ("yes", True), ("YES", True),
                        ("false", False), ("0", False), ("no", False), ("False", False)]:
        assert toy(["--finetune", text]).finetune is value
    assert toy(["--finetune"]).finetune is True  # bare: true
    assert toy(["--no-progress"]).progress is False
    assert toy(["--progress", "no"]).progress is False
    assert toy(["--finetune", "--no-finetune"]).finetune is False  # the last one wins
    for bad in ("2", "y", "on", ""):
        with pytest.raises(argparse.ArgumentTypeError, match=repr(bad)):
            cli.parse_bool(bad)


def test_preset_then_flags():
    big = toy(["--preset", "big"])
    assert (big.batch_size, big.lr, big.preset) == (64, 0.01, "big")
    cfg = toy(["--preset", "big", "--lr", "0.5"])  # an explicit flag beats the preset
    assert (cfg.batch_size, cfg.lr) == (64, 0.5)
    # A flag equal to the field's default still overrides the preset.
    assert toy(["--preset", "big", "--batch-size", "8"]).batch_size == 8
    assert toy(["--lr", "0.5", "--preset", "big"]).lr == 0.5  # order does not matter


def test_required_and_positional(capsys):
    assert "the following arguments are required: --name" in error_of(
        [], capsys, required=("name",))
    assert toy(["x"], positional=("name",)).name == "x"
    with pytest.raises(ValueError, match="'nope' is not a field of Toy"):
        parser(required=("nope",))


def test_value_errors_from_make_are_usage_errors(capsys):
    def strict(preset="small", **flags):
        cfg = make_toy(preset, **flags)
        if cfg.batch_size < 2:
            raise ValueError(f"batch_size must be >= 2, got {cfg.batch_size}")
        return cfg

    with pytest.raises(SystemExit):
        cli.parse(parser(), strict, ["--batch-size", "1"])
    err = capsys.readouterr().err
    assert err == "error: batch_size must be >= 2, got 1 (toy --help lists the flags)\n"


def test_build_checks_names_and_types():
    assert cli.build(Toy, {"lr": 1}, {"dims": None}).lr == 1  # an int is a fine float
    with pytest.raises(ValueError, match="unknown config field 'learning_rate'"):
        cli.build(Toy, {"learning_rate": 0.1})
    with pytest.raises(ValueError, match="batch_size must be of type int, got '8'"):
        cli.build(Toy, {"batch_size": "8"})
    with pytest.raises(ValueError, match="finetune must be of type bool, got 1"):
        cli.build(Toy, {"finetune": 1})
    with pytest.raises(ValueError, match="batch_size must be of type int, got True"):
        cli.build(Toy, {"batch_size": True})


def test_help_lists_every_field_with_its_default_and_the_presets(capsys):
    with pytest.raises(SystemExit) as e:
        toy(["--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for flag, default in [("--name", "''"), ("--batch-size", "8"), ("--lr", "0.1"),
                          ("--dims", "None"), ("--finetune", "False"), ("--progress", "True"),
                          ("--mode", "'a'"), ("--preset", "small")]:
        assert f"{flag} " in out and f"default: {default}" in out
    assert "--no-progress" in out and "--preset-" not in out
    assert "small: the defaults" in out and "big: batch_size=64, lr=0.01" in out


class ToySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOY_", frozen=True, extra="forbid")

    port: int = Field(default=8000, ge=0, le=65535, description="TCP port")
    origins: list[str] = []
    level: Literal["info", "debug"] = "info"


def test_pydantic_settings_flags_override_the_environment(monkeypatch, capsys):
    p = cli.build_parser(ToySettings, prog="toy")
    monkeypatch.setenv("TOY_PORT", "9000")
    monkeypatch.setenv("TOY_LEVEL", "debug")
    s = cli.parse(p, ToySettings, ["--origins", "a", "b"])
    assert (s.port, s.origins, s.level) == (9000, ["a", "b"], "debug")  # env, then flags
    s = cli.parse(p, ToySettings, ["--port", "8001", "--level", "info"])
    assert (s.port, s.level) == (8001, "info")
    for argv, message in [(["--port", "70000"], "less than or equal to 65535"),
                          (["--level", "loud"], "invalid choice: 'loud'")]:
        with pytest.raises(SystemExit):
            cli.parse(p, ToySettings, argv)
        assert message in capsys.readouterr().err
    help_text = " ".join(p.format_help().split())
    assert "TCP port; env TOY_PORT; default: 8000" in help_text


def test_usage_errors_are_one_line(capsys):
    err = error_of(["--batch-size", "two"], capsys)
    assert err.count("\n") == 1 and err.startswith("error: argument --batch-size")


def test_log_level_is_a_flag_of_every_parser_but_no_field():
    assert toy(["--log-level", "debug"]) == Toy()
    assert cli.log_level_of(["--x", "1", "--log-level", "warning"]) == "warning"
    assert cli.log_level_of(["--log-level=debug"]) == "debug"
    assert cli.log_level_of([]) == "info"


@pytest.mark.parametrize("err", [
    ValueError("epochs must be >= 1, got 0"),
    FileNotFoundError(2, "No such file or directory", "runs/x/checkpoint.pt"),
    cli.UserError("index folder runs/ix is locked by pid 12"),
])
def test_main_reports_user_errors_in_one_line_with_status_2(err, capsys):
    def body(argv):
        raise err

    assert cli.main(body, []) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and out.err.startswith("error: ")
    assert "Traceback" not in out.err
    if isinstance(err, OSError):
        assert "runs/x/checkpoint.pt" in out.err
    assert cli.main(body, ["--log-level", "debug"]) == 2
    assert "Traceback" in capsys.readouterr().err  # debug shows where it came from


def test_main_lets_bugs_through_and_returns_the_bodys_status():
    def bug(argv):
        raise KeyError("x")

    with pytest.raises(KeyError):
        cli.main(bug, [])
    assert cli.main(lambda argv: 3, []) == 3
    assert cli.main(lambda argv: None, []) == 0


def test_other_libraries_log_only_warnings(capsys):
    import logging

    cli.setup_logging("info")
    logging.getLogger("onnxscript.exporter").info("Replaced initializer")
    logging.getLogger("training.cdk.x").info("ours")
    err = capsys.readouterr().err
    assert "ours" in err and "Replaced initializer" not in err
