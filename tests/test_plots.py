"""vit/tools/plots.py and views.py: curves against step and time, figures of the set size, nothing drawn where there is no data."""

from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from vit.tools import plots, views
from vit.models.encoder import VisionTransformer


@dataclass
class Curve:
    steps: list[float]
    times: list[float | None]
    values: list[float]


def image_of(path: Path) -> tuple[tuple[int, int], int]:
    """(width, height) and the spread of grey levels (0: a blank image)."""
    with Image.open(path) as im:
        lo, hi = im.convert("L").getextrema()
        return im.size, hi - lo


def test_xy_drops_untimed_points_against_time_only():
    curve = Curve([1, 2, 3], [None, 4.0, 6.0], [0.5, 0.4, 0.3])
    assert plots.xy(curve, "step") == ([1, 2, 3], [0.5, 0.4, 0.3])
    assert plots.xy(curve, "time") == ([4.0, 6.0], [0.4, 0.3])


def test_colours_are_one_per_name_and_stable():
    names = [f"run{i}" for i in range(12)]  # more than tab10 holds: tab20
    colour = plots.colours(names)
    assert list(colour) == names and len(set(colour.values())) == 12
    assert plots.colours(names[:3]) == plots.colours(names[:3])


def test_curves_and_bars_are_drawn_at_the_set_size_and_skipped_without_data(tmp_path):
    size = (int(plots.FIGSIZE[0] * plots.DPI), int(plots.FIGSIZE[1] * plots.DPI))
    colour = plots.colours(["a", "b"])
    curves = {"a": Curve([1, 2, 3], [1.0, 2.0, 3.0], [1e-3, 1e-2, 1e-1]), "b": Curve([1, 2], [None, None], [0.0, -1.0])}
    drawn = plots.plot_curves(curves, "step", tmp_path / "lr.png", colour, "lr", "lr", log=True)
    assert drawn == tmp_path / "lr.png" and image_of(drawn)[0] == size and image_of(drawn)[1] > 100
    # Against time, "a" alone has points; on a log scale "b" has none above zero, so with "b" alone nothing is drawn.
    assert plots.plot_curves({"b": curves["b"]}, "step", tmp_path / "none.png", colour, "lr", "lr", log=True) is None
    assert plots.plot_curves({"b": curves["b"]}, "time", tmp_path / "none.png", colour, "lr", "lr") is None
    assert not (tmp_path / "none.png").exists()

    assert plots.plot_loss({}, "step", tmp_path / "loss.png", colour) is None
    panels = {"first": {"a": (curves["a"], Curve([3], [3.0], [0.2]))}, "second": {"b": (curves["b"], Curve([], [], []))}}
    assert image_of(plots.plot_loss(panels, "step", tmp_path / "loss.png", colour))[0] == size

    assert plots.plot_final_accuracy([{"name": "x", "val_top1": None}], tmp_path / "bars.png") is None
    rows = [{"name": "x", "val_top1": 0.5, "best_val_top1": 0.6, "test_top1": None}]
    assert image_of(plots.plot_final_accuracy(rows, tmp_path / "bars.png"))[0] == size
    assert plots.plot_accuracy_vs_pretraining({}, tmp_path / "pts.png") is None
    assert image_of(plots.plot_accuracy_vs_pretraining({"linprobe": {0.0: [0.3], 10.0: [0.4, 0.5]}}, tmp_path / "pts.png"))[0] == size


def test_encoder_figures_are_written_and_the_sincos_table_needs_a_width_divisible_by_four(tmp_path):
    torch.manual_seed(0)
    encoder = VisionTransformer(img_size=16, patch_size=4, embed_dim=8, depth=2, num_heads=2, num_classes=0).eval()
    images = torch.rand(2, 3, 16, 16)
    maps = encoder.attention_maps(images)
    written = [
        views.figure_attention_heads(images, maps[-1], tmp_path / "heads.png"),
        views.figure_rollout(images, maps, tmp_path / "rollout.png"),
        views.figure_pos_similarity(encoder.pos_embed, tmp_path / "pos.png"),
        views.figure_patch_grid(images, 4, tmp_path / "grid.png"),
        views.figure_sincos_table(encoder, tmp_path / "sincos.png"),
    ]
    for path in written:
        (w, h), spread = image_of(path)
        assert w > 100 and h > 100 and spread > 100, path.name
    odd = VisionTransformer(img_size=16, patch_size=4, embed_dim=6, depth=1, num_heads=2, num_classes=0)
    assert views.figure_sincos_table(odd, tmp_path / "odd.png") is None and not (tmp_path / "odd.png").exists()
