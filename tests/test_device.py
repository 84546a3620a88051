import torch

from training.device import pick_device


def test_auto_follows_cuda_availability():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    for name in (None, "", "auto"):
        assert pick_device(name).type == expected


def test_explicit_device_is_kept():
    assert pick_device("cpu") == torch.device("cpu")
    assert pick_device(torch.device("cpu")) == torch.device("cpu")
    assert pick_device("cuda:1") == torch.device("cuda", 1)
