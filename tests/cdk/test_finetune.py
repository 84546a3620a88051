"""Fine-tuning path of training.cdk.train: stage splits, frozen BatchNorm statistics, frozen
trunk and its cache, images checked up front, seeded augmentation independent of the worker
count, the stored spectrum, resume, the Embedder on fine-tuned checkpoints, and the paper
preset (frozen VGG16 features) with VGG16 fine-tuned beside it."""

import copy

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image

from tests.cdk.reference import cdk_matrix, rayleigh_quotients
from training.cdk import finetune
from training.cdk import train as train_mod
from training.cdk.checkpoint import load_checkpoint
from training.cdk.config import make_config
from training.cdk.data import scan
from training.cdk.features import extract_features
from training.cdk.finetune import Split, StepImages
from training.cdk.inputs import ImageInputs, PairModel
from training.cdk.make_bundle import embedder_of_checkpoint
from training.cdk.model.backbones import BACKBONES, bare_backbone, build_backbone
from training.cdk.model.heads import MODALITIES, Head, retrieval_embedding
from training.cdk.run import embed_features
from training.cdk.train import TrainData
from training.images import ImageError, images_to_tensor, load_image

SIZE = 32


def _write_dataset(root, n=4, classes=("apple", "boat")):
    """Two classes of small generated images: sketches dark strokes on white, photos colour."""
    rng = np.random.default_rng(0)
    for c, cls in enumerate(classes):
        for mod in ("sketch", "photo"):
            (root / mod / cls).mkdir(parents=True)
            for i in range(n):
                if mod == "sketch":
                    a = np.full((40, 40, 3), 255, np.uint8)
                    r = rng.integers(5, 30)
                    a[r : r + 4, 5:35] = 0 if c == 0 else 120
                    a[5:35, r : r + 4] = 0
                else:
                    a = (rng.random((40, 40, 3)) * 80).astype(np.uint8)
                    a[..., c] += 150
                Image.fromarray(a).save(root / mod / cls / f"{cls}{i}.png")
    return root


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return scan(_write_dataset(tmp_path_factory.mktemp("data")))


@pytest.fixture(scope="module")
def lite0():
    return build_backbone("efficientnet-lite0")


def _data(ds, bb, size=SIZE):
    feats = [extract_features(f, bb, size, None, device="cpu") for f in (ds.sketches, ds.photos)]
    return TrainData(feats[0], feats[1], ds.sketch_labels, ds.photo_labels, None,
                     list(ds.sketches), list(ds.photos))


def _cfg(tmp_path, **kw):
    base = dict(modes=4, hidden=16, batch_size=4, epochs=2, lr=0.05, backbone_lr=0.01,
                image_size=SIZE, finetune=True, photo_flip_average=False, raw_dims=0,
                instance_share=0.0, out=str(tmp_path),
                cache_dir=str(tmp_path / "cache"))
    return make_config("cpu", **{**base, **kw})


def _bn_stats(module):
    return {k: v.clone() for k, v in module.state_dict().items() if "running" in k}


@pytest.mark.parametrize("name", ["efficientnet-lite0", "efficientnet-lite1",
                                  "efficientnet-lite2", "vgg16"])
def test_split_tail_of_trunk_is_the_backbone(name):
    torch.manual_seed(0)
    module = bare_backbone(name).module.eval()  # random weights: the split, not the values
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        ref = module(x)
        count = BACKBONES[name].stage_count
        for K in sorted({0, 1, 2, count}):
            s = Split(module, name, K)
            torch.testing.assert_close(s.tail(s.trunk(x)), ref)
    assert len(BACKBONES[name].stages(module.trunk).blocks) == count
    with pytest.raises(ValueError, match="trainable_stages"):
        Split(module, name, count + 1)


def test_native_sizes_resolve_and_bad_values_are_named():
    assert make_config("cpu", backbone="efficientnet-lite2", image_size=0).image_size == 260
    assert make_config("cpu", backbone="efficientnet-lite1", image_size=0).image_size == 240
    assert BACKBONES["vgg16"].native_size == make_config("cpu", backbone="vgg16",
                                                         image_size=0).image_size == 224
    with pytest.raises(ValueError, match="trainable_stages"):
        make_config("cpu", backbone="efficientnet-lite0", finetune=True,
                    photo_flip_average=False, raw_dims=0, trainable_stages=17)
    with pytest.raises(ValueError, match="workers"):
        make_config("cpu", workers=-1)


def test_frozen_bn_keeps_pretrained_statistics_and_trunk_stays_fixed(dataset, lite0, tmp_path):
    before = _bn_stats(lite0.module)
    params0 = {k: v.clone() for k, v in lite0.module.state_dict().items()}
    res = train_mod.train(_cfg(tmp_path / "f", trainable_stages=2), _data(dataset, lite0),
                          lite0, tmp_path / "f")
    for m in ("sketch", "photo"):
        after = _bn_stats(res.backbones[m])
        for k, v in before.items():  # over several epochs and spectrum passes
            torch.testing.assert_close(after[k], v, rtol=0, atol=0)
        sd = res.backbones[m].state_dict()
        assert torch.equal(sd["trunk.net._blocks.0._depthwise_conv.weight"],
                           params0["trunk.net._blocks.0._depthwise_conv.weight"])
        assert not torch.equal(sd["trunk.net._conv_head.weight"],
                               params0["trunk.net._conv_head.weight"])
    assert res.backbones["sketch"] is not res.backbones["photo"]


def test_truncated_image_stops_before_any_step(tmp_path, lite0, monkeypatch):
    root = _write_dataset(tmp_path / "d")
    ds = scan(root)
    data = _data(ds, lite0)
    bad = ds.photos[3]
    bad.write_bytes(bad.read_bytes()[:60])  # truncated after extract_features read it
    steps = []
    real = train_mod.cdk_loss
    monkeypatch.setattr(train_mod, "cdk_loss", lambda *a: steps.append(1) or real(*a))
    with pytest.raises(ImageError, match=bad.name):
        train_mod.train(_cfg(tmp_path / "o"), data, lite0, tmp_path / "o")
    assert steps == [] and not (tmp_path / "o" / "checkpoint.pt").exists()


def test_augmented_views_are_seeded_by_item_not_by_worker(dataset):
    im = StepImages(dataset.sketches, dataset.photos, SIZE, (0.5,) * 3, (0.5,) * 3, True, 0)
    a, b = im[(0, 1, 0)], im[(0, 1, 0)]
    assert a.shape == (3, SIZE, SIZE) and torch.equal(a, b)
    assert not torch.equal(a, im[(0, 1, 1)])  # another epoch, another view
    plain = StepImages(dataset.sketches, dataset.photos, SIZE, (0.5,) * 3, (0.5,) * 3,
                       False, 0)
    assert not torch.equal(a, plain[(0, 1, 0)])


def test_workers_and_chunks_do_not_change_the_result(dataset, lite0, tmp_path, monkeypatch):
    kw = dict(trainable_stages=1, augment=True, epochs=1)
    data = _data(dataset, lite0)
    r0 = train_mod.train(_cfg(tmp_path / "w0", workers=0, **kw), data, lite0, tmp_path / "w0")
    monkeypatch.setattr(finetune, "CHUNK", 3)  # a step's 8 images arrive in 3 loader items
    r2 = train_mod.train(_cfg(tmp_path / "w2", workers=2, **kw), data, lite0, tmp_path / "w2")
    for m in ("sketch", "photo"):
        for k, v in r0.backbones[m].state_dict().items():
            torch.testing.assert_close(r2.backbones[m].state_dict()[k], v, rtol=0, atol=0)


def test_spectrum_features_decoded_by_workers_equal_the_main_thread(dataset, lite0, tmp_path):
    # the unaugmented features of the spectrum pass and the head phase come through a
    # DataLoader (cfg.workers processes); they must be what decoding in place gives
    data = _data(dataset, lite0)
    splits = {m: Split(copy.deepcopy(lite0.module), lite0.name, 1) for m in MODALITIES}
    heads = {m: Head(lite0.feature_dim, 16, 4, 16.0) for m in MODALITIES}
    model = PairModel(heads, {m: s.module for m, s in splits.items()}, splits).eval()
    idx = [5, 0, 3]
    both = {"sketch": data.sketch_files, "photo": data.photo_files}
    for workers in (0, 2):
        inputs = ImageInputs(both, lite0, model, SIZE, True, 0, workers, None,
                             torch.device("cpu"))
        for mod, files in (("sketch", dataset.sketches), ("photo", dataset.photos)):
            x = images_to_tensor([load_image(files[j]) for j in idx], SIZE, lite0.mean,
                                 lite0.std)
            with torch.no_grad():
                ref = splits[mod].tail(splits[mod].trunk(x))
            torch.testing.assert_close(inputs.features(mod, idx), ref, rtol=0, atol=0)


def test_trunk_cache_equals_trunk_at_every_step(dataset, lite0, tmp_path, monkeypatch):
    data = _data(dataset, lite0)
    cached = train_mod.train(_cfg(tmp_path / "c", trainable_stages=3), data, lite0,
                             tmp_path / "c")

    class NoCache(ImageInputs):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            assert self.cache is not None
            self.cache = None

    monkeypatch.setattr(train_mod, "ImageInputs", NoCache)
    direct = train_mod.train(_cfg(tmp_path / "d", trainable_stages=3), data, lite0,
                             tmp_path / "d")
    for m in ("sketch", "photo"):
        for k, v in cached.heads[m].state_dict().items():
            torch.testing.assert_close(direct.heads[m].state_dict()[k], v, rtol=1e-4, atol=1e-5)


def test_trunk_activations_are_cached_on_disk(dataset, lite0, tmp_path, monkeypatch):
    split = Split(lite0.module, lite0.name, 2)
    files = list(dataset.sketches)
    first = finetune.trunk_cache(split, files, lite0, SIZE, "cpu", tmp_path)
    assert len(list(tmp_path.glob("*trunk2*.pt"))) == 1

    def no_pass(*a, **kw):
        raise AssertionError("the trunk ran although its activations were cached")

    monkeypatch.setattr(finetune, "_trunk_outputs", no_pass)
    again = finetune.trunk_cache(split, files, lite0, SIZE, "cpu", tmp_path)
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    # another split of the same backbone is another entry, never the cached one
    with pytest.raises(AssertionError, match="trunk ran"):
        finetune.trunk_cache(Split(lite0.module, lite0.name, 1), files, lite0, SIZE, "cpu",
                             tmp_path)
    monkeypatch.undo()
    lite0.module.eval()
    with torch.no_grad():
        direct = split.trunk(torch.stack([
        StepImages(files, files, SIZE, lite0.mean, lite0.std, False, 0)[(0, i, 0)]
            for i in range(len(files))]))
    torch.testing.assert_close(first, direct, rtol=1e-4, atol=1e-5)


def test_fine_tuned_run_stores_the_spectrum_of_its_final_backbones(dataset, lite0, tmp_path):
    res = train_mod.train(_cfg(tmp_path, trainable_stages=1, sort_modes=False), _data(dataset,
                                                                                     lite0),
                          lite0, tmp_path)
    ck = load_checkpoint(tmp_path / "checkpoint.pt")
    assert ck["epoch"] == 2 and len(ck["history"]) == 2
    # the stored spectrum over every training image (8 < the 1024 of the subset): the CDK's
    # Rayleigh quotients against the kernel written out as a matrix, and
    # sqrt(E f_l^2 E g_l^2)
    f = embed_features(res.heads["sketch"], extract_features(
        dataset.sketches, lite0, SIZE, None, module=res.backbones["sketch"]), "cpu")
    g = embed_features(res.heads["photo"], extract_features(
        dataset.photos, lite0, SIZE, None, module=res.backbones["photo"]), "cpu")
    K = cdk_matrix(dataset.sketch_labels, dataset.photo_labels)
    torch.testing.assert_close(ck["singular_values"], rayleigh_quotients(f, g, K).float(),
                               rtol=1e-4, atol=1e-5)
    ref = torch.sqrt((f**2).mean(0) * (g**2).mean(0))
    torch.testing.assert_close(ck["singular_values_norm"], ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cut", [1, 2])  # after the first epoch, after the second
def test_resume_reproduces_the_uninterrupted_run(dataset, lite0, tmp_path, monkeypatch, cut):
    monkeypatch.setattr(train_mod, "CHECKPOINT_SECONDS", 0.0)  # a checkpoint every epoch
    kw = dict(trainable_stages=2, augment=True, epochs=3)
    data = _data(dataset, lite0)
    full = train_mod.train(_cfg(tmp_path / "full", **kw), data, lite0, tmp_path / "full")
    real_save, calls = train_mod.save_checkpoint, []

    def crash(*a, **k):
        real_save(*a, **k)
        calls.append(1)
        if len(calls) == cut:
            raise KeyboardInterrupt("simulated interruption")

    monkeypatch.setattr(train_mod, "save_checkpoint", crash)
    with pytest.raises(KeyboardInterrupt):
        train_mod.train(_cfg(tmp_path / "cut", **kw), data, lite0, tmp_path / "cut")
    assert load_checkpoint(tmp_path / "cut" / "checkpoint.pt")["epoch"] == cut
    res = train_mod.train(_cfg(tmp_path / "cut", **kw), data, lite0, tmp_path / "cut")
    for m in ("sketch", "photo"):
        for a, b in ((full.heads[m], res.heads[m]), (full.backbones[m], res.backbones[m])):
            for k, v in a.state_dict().items():
                torch.testing.assert_close(b.state_dict()[k], v, rtol=0, atol=0)
    torch.testing.assert_close(res.singular_values, full.singular_values, rtol=0, atol=0)


def test_embedder_embeds_as_evaluation_does(dataset, lite0, tmp_path):
    res = train_mod.train(_cfg(tmp_path, trainable_stages=1, epochs=1),
                          _data(dataset, lite0), lite0, tmp_path)
    assert res.backbones["sketch"] is not res.backbones["photo"]
    e = embedder_of_checkpoint(tmp_path / "checkpoint.pt", "cpu")[0]
    assert e.image_size == SIZE
    for mod, files in (("sketch", dataset.sketches), ("photo", dataset.photos)):
        ref = retrieval_embedding(embed_features(res.heads[mod], extract_features(
            files, lite0, SIZE, None, module=res.backbones[mod]), "cpu"), e.unit_embeddings)
        assert e.unit_embeddings  # the cpu preset's; evaluation embeds so too
        from training.images import load_image

        z = e.embed([load_image(f) for f in files], mod)
        np.testing.assert_allclose(z, ref.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("finetune", [False, True])
def test_paper_preset_and_vgg16_fine_tuned_end_to_end(tmp_path, finetune):
    torch.manual_seed(0)
    trunk = torchvision.models.vgg.make_layers(torchvision.models.vgg.cfgs["D"])
    weights = tmp_path / "vgg16.pth"
    torch.save({f"features.{k}": v for k, v in trunk.state_dict().items()}, weights)
    ds = scan(_write_dataset(tmp_path / "d", n=4))
    cfg = make_config("paper", batch_size=8, epochs=1, image_size=SIZE, modes=8, hidden=16,
                      backbone_weights=str(weights), finetune=finetune, out=str(tmp_path / "o"))
    assert cfg.backbone == "vgg16" and cfg.trainable_stages == 0
    assert cfg.pooling == "avg" and cfg.smooth_k == 0  # the paper's pooled features, no smoothing
    bb = build_backbone(cfg.backbone, cfg.backbone_weights, pooling=cfg.pooling)
    train_mod.train(cfg, _data(ds, bb), bb, cfg.out, device="cpu")
    ck = load_checkpoint(tmp_path / "o" / "checkpoint.pt")
    assert ck["epoch"] == 1 and ck["backbone"]["finetuned"] == finetune
    assert ck["config"]["preset"] == "paper"
    e = embedder_of_checkpoint(tmp_path / "o" / "checkpoint.pt", "cpu")[0]
    z = e.embed([Image.new("RGB", (40, 40), (200, 10, 10))], "photo")
    assert z.shape == (1, 8) and np.isfinite(z).all()
