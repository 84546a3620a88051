"""Pseudo-sketches on real photos: deterministic, the asked size, dark strokes on white
paper, neither blank nor black, and different views for different seeds and styles."""

import numpy as np
import pytest
from PIL import Image

from training.cdk.pseudo import STYLES, Style, pseudo_sketch, pseudo_sketches, view_seed
from training.images import load_image


@pytest.fixture
def photos(sketchy_mini):
    return [load_image(sorted((sketchy_mini / "photo" / c).iterdir())[0])
            for c in ("airplane", "cat", "teapot")]


def _ink(im: Image.Image) -> float:
    a = np.asarray(im.convert("L"), dtype=np.float64)
    return float((a < 128).mean())


def test_views_look_like_sketches(photos):
    for photo in photos:
        views = pseudo_sketches(photo, STYLES, seed=0, size=240, key="p")
        assert len(views) == len(STYLES)
        for v in views:
            assert v.mode == "RGB" and v.size == (240, 240)
            a = np.asarray(v)
            assert (a[..., 0] == a[..., 1]).all() and (a[..., 1] == a[..., 2]).all()  # grey
            # white paper with some dark strokes: not blank, not all black
            assert 0.005 < _ink(v) < 0.25
            assert np.median(a) == 255


def test_views_are_deterministic_and_vary_with_seed_and_style(photos):
    photo = photos[1]
    a = pseudo_sketches(photo, STYLES, seed=3, size=128, key="cat")
    b = pseudo_sketches(photo, STYLES, seed=3, size=128, key="cat")
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    other_seed = pseudo_sketches(photo, STYLES, seed=4, size=128, key="cat")
    assert all(not np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(a, other_seed, strict=True))
    assert not np.array_equal(np.asarray(a[0]), np.asarray(a[1]))
    assert view_seed(0, "x") == view_seed(0, "x") != view_seed(1, "x")


def test_a_flat_photo_gives_a_blank_page_and_bad_styles_are_refused():
    flat = Image.new("RGB", (100, 60), (120, 90, 60))
    v = pseudo_sketch(flat, STYLES["contour"], seed=0, size=64)
    assert v.size == (64, 64) and _ink(v) == 0
    with pytest.raises(ValueError, match="edges"):
        Style(edges="sobel")
    with pytest.raises(ValueError, match="drop"):
        Style(drop=1.0)
    with pytest.raises(ValueError, match="size"):
        pseudo_sketch(flat, STYLES["canny"], seed=0, size=4)


def test_views_of_a_drawn_sketch_keep_its_strokes(sketchy_mini):
    from training.cdk.pseudo import SKETCH_STYLES, sketch_view

    sketch = load_image(sorted((sketchy_mini / "sketch" / "cat").iterdir())[0])
    thin = sketch_view(sketch, SKETCH_STYLES["thin"], seed=0, size=128)
    thick = sketch_view(sketch, SKETCH_STYLES["thick"], seed=0, size=128)
    again = sketch_view(sketch, SKETCH_STYLES["thin"], seed=0, size=128)
    np.testing.assert_array_equal(np.asarray(thin), np.asarray(again))
    assert thin.size == thick.size == (128, 128)
    assert 0 < _ink(thin) < _ink(thick) < 0.5  # the thicker pen puts down more ink
