"""The flags of python -m index.build and index.add: one per field of their frozen config
dataclasses (training.cli), today's names kept."""

import dataclasses

import pytest

from index.add import AddConfig
from index.add import parse_args as add_args
from index.build import BuildConfig
from index.build import parse_args as build_args

REQUIRED = ["--model", "m", "--photos", "p", "--out", "o"]


def test_build_flags():
    assert build_args(REQUIRED) == BuildConfig(model="m", photos="p", out="o")
    cfg = build_args([*REQUIRED, "--dims", "8", "--kind", "ivf", "--batch-size", "4",
                      "--recall-k", "5", "--device", "cpu", "--threads", "1",
                      "--no-progress", "--feature-cache", "none", "--workers", "0",
                      "--encoder", "torch", "--kind", "ivfsq48", "--shard-size", "7"])
    assert (cfg.dims, cfg.kind, cfg.batch_size, cfg.recall_k, cfg.device, cfg.threads) == \
        (8, "ivfsq48", 4, 5, "cpu", 1)
    assert (cfg.feature_cache, cfg.workers, cfg.encoder, cfg.shard_size) == ("none", 0,
                                                                             "torch", 7)
    assert cfg.progress is False
    assert build_args([*REQUIRED, "--progress", "no"]).progress is False


def test_add_flags():
    assert add_args(["--index", "i", "--photos", "p"]) == AddConfig(index="i", photos="p")
    cfg = add_args(["--index", "i", "--photos", "p", "--model", "c", "--batch-size", "2",
                    "--no-progress", "--feature-cache", "cache", "--workers", "3",
                    "--encoder", "onnx"])
    assert (cfg.model, cfg.batch_size, cfg.progress) == ("c", 2, False)
    assert (cfg.feature_cache, cfg.workers, cfg.encoder) == ("cache", 3, "onnx")


@pytest.mark.parametrize("argv,message", [
    (REQUIRED[:4], "the following arguments are required: --out"),
    ([*REQUIRED, "--kind", "lsh"], "invalid choice: 'lsh'"),
    ([*REQUIRED, "--encoder", "tensorrt"], "invalid choice: 'tensorrt'"),
    ([*REQUIRED, "--dims", "all"], "argument --dims: invalid int value: 'all'"),
    ([*REQUIRED, "--batch_size", "4"], "unrecognized arguments: --batch_size"),
    ([*REQUIRED, "--progress", "maybe"], "argument --progress: expected one of"),
    ([*REQUIRED, "--checkpoint", "c.pt"], "unrecognized arguments: --checkpoint"),
])
def test_build_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        build_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("parse,cls", [(build_args, BuildConfig), (add_args, AddConfig)])
def test_help_lists_every_field(parse, cls, capsys):
    with pytest.raises(SystemExit):
        parse(["--help"])
    out = capsys.readouterr().out
    for f in dataclasses.fields(cls):
        assert "--" + f.name.replace("_", "-") in out
