"""Adapting trained heads to a gallery: on a tiny real gallery, pseudo-sketches of a class
the heads never saw find their own class after adaptation; the inputs are not changed and
bad arguments are refused."""

import numpy as np
import pytest
import torch

from training.cdk.adapt import Adaptation, adapt_heads
from training.cdk.data import PairSampler, scan
from training.cdk.features import extract_features
from training.cdk.metrics import retrieval_metrics
from training.cdk.model.backbones import build_backbone
from training.cdk.model.heads import Head, retrieval_embedding
from training.cdk.pseudo import STYLES, pseudo_sketch, view_features, view_seed
from training.loss import cdk_loss, nesting_masks

SIZE = 96
TRAINED = ("airplane", "cat", "chair", "teapot")
UNSEEN = ("tree",)


def _heads(sketch_feats, photo_feats, modes=16, seed=0):
    torch.manual_seed(seed)
    heads = {m: Head(sketch_feats.shape[1], 64, modes, 16.0) for m in ("sketch", "photo")}
    heads["sketch"].set_feature_stats(sketch_feats)
    heads["photo"].set_feature_stats(photo_feats)
    return heads


def _train(heads, sketch_feats, photo_feats, sampler, epochs=60):
    """The heads trained on real pairs by the CDK loss (the training loop in small)."""
    masks = nesting_masks(heads["sketch"].modes, "joint", constant_mode=True)
    params = [p for h in heads.values() for p in h.parameters()]
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    for epoch in range(epochs):
        for s, p in sampler.epoch(0, epoch, 32):
            loss = cdk_loss(heads["sketch"](sketch_feats[s]), heads["photo"](photo_feats[p]),
                            *masks)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return {m: h.eval() for m, h in heads.items()}


@pytest.fixture(scope="module")
def tiny_real(tmp_path_factory):
    from .conftest import SKETCHY_MINI

    if not (SKETCHY_MINI / "photo").is_dir():
        pytest.skip(f"sketchy-mini not found at {SKETCHY_MINI}")
    ds = scan(SKETCHY_MINI)
    tr, gallery = ds.restrict(list(TRAINED)), ds.restrict(list(TRAINED + UNSEEN))
    bb = build_backbone("efficientnet-lite0")
    cache = tmp_path_factory.mktemp("cache")
    feats = {"sketch": extract_features(tr.sketches, bb, SIZE, cache),
             "photo": extract_features(tr.photos, bb, SIZE, cache),
             "gallery": extract_features(gallery.photos, bb, SIZE, cache)}
    style = STYLES["detail"]

    def views(seed):  # pseudo-sketches of every gallery photo
        return view_features(gallery.photos, lambda j, im: pseudo_sketch(
            im, style, view_seed(seed, str(gallery.photos[j])), SIZE), f"detail|{seed}", bb,
            SIZE, cache)

    return tr, gallery, feats, views(0)


def test_adapted_heads_find_an_unseen_class_from_its_pseudo_sketches(tiny_real):
    """The gallery holds a class the heads never trained on; after adaptation its photos'
    pseudo-sketches rank the photos of their own class higher (mean AP against the whole
    gallery), and the trained heads are left as they were."""
    tr, gallery, F, views = tiny_real
    sampler = PairSampler(tr.sketch_labels, tr.photo_labels, "class", tr.instance_pairs(), 0.5)
    heads = _train(_heads(F["sketch"], F["photo"]), F["sketch"], F["photo"], sampler)
    before = {m: {k: v.clone() for k, v in h.state_dict().items()} for m, h in heads.items()}
    adapted = adapt_heads(heads, (F["sketch"], F["photo"]), sampler, views, F["gallery"],
                          torch.arange(len(views)), Adaptation(steps=150, batch_size=64,
                                                               lr=0.02))
    for m, h in heads.items():
        for k, v in h.state_dict().items():
            torch.testing.assert_close(v, before[m][k])

    unseen = gallery.classes.index(UNSEEN[0])
    rows = np.flatnonzero(gallery.photo_labels == unseen)

    def unseen_map(hs):
        with torch.no_grad():
            f = retrieval_embedding(hs["sketch"](views[rows]), True)
            g = retrieval_embedding(hs["photo"](F["gallery"]), True)
        return retrieval_metrics(f, g, gallery.photo_labels[rows], gallery.photo_labels,
                                 5)["map_all"]

    map_before, map_after = unseen_map(heads), unseen_map(adapted)
    assert map_after > map_before + 0.03, (map_before, map_after)


def test_adaptation_refuses_bad_arguments():
    heads = _heads(torch.randn(8, 4), torch.randn(8, 4), modes=2)
    sampler = PairSampler(np.arange(8) % 2, np.arange(8) % 2)
    feats = (torch.randn(8, 4), torch.randn(8, 4))
    with pytest.raises(ValueError, match="view_photo"):
        adapt_heads(heads, feats, sampler, torch.randn(3, 4), torch.randn(5, 4),
                    torch.tensor([0, 1]), Adaptation(steps=1, batch_size=4))
    with pytest.raises(ValueError, match="index the 5 gallery photos"):
        adapt_heads(heads, feats, sampler, torch.randn(2, 4), torch.randn(5, 4),
                    torch.tensor([0, 5]), Adaptation(steps=1, batch_size=4))
    with pytest.raises(ValueError, match="gallery_share"):
        Adaptation(gallery_share=1.0)
