"""Hostile checks of the figures (vit/tools/plots.py, vit/tools/views.py, pretrain/figures.py, pretrain/visualize.py): each
figure draws what its title says, read from the drawn arrays and the title text."""

from pathlib import Path

import pytest
import torch
from PIL import Image

from pretrain.model import MaskedAutoencoder
from pretrain.visualize import load_checkpoint, visualize
from vit.eval.attention import upsample_maps
from vit.models.encoder import VisionTransformer
from vit.store.checkpoint import CLASSIFIER_FORMAT
from vit.tools import plots, views

MEAN, STD = [0.1, 0.2, 0.3], [0.4, 0.5, 0.6]


def write_classifier(folder: Path, arch: str) -> tuple[Path, VisionTransformer]:
    """A classifier.pt whose head averages the patch tokens: a fine-tune with global_pool=avg, or a linear probe that pools
    by 'avg' over an encoder whose own config says 'token'."""
    torch.manual_seed(0)
    folder.mkdir(parents=True)
    if arch == "vit":
        vit = VisionTransformer(img_size=16, patch_size=4, embed_dim=16, depth=2, num_heads=2, num_classes=3, global_pool="avg")
        build, state = {"config": vit.config}, vit.state_dict()
    else:
        vit = VisionTransformer(img_size=16, patch_size=4, embed_dim=16, depth=2, num_heads=2, num_classes=0)
        build = {"config": vit.config, "pool": "avg", "num_classes": 3}
        state = {f"encoder.{k}": v for k, v in vit.state_dict().items()} | {"head.1.weight": torch.zeros(3, 16)}
    payload = {"format": CLASSIFIER_FORMAT, "arch": arch, "build": build, "state_dict": state, "classes": ["a", "b", "c"],
               "data": {"dataset": "synthetic", "mean": MEAN, "std": STD}}  # fmt: skip
    torch.save(payload, folder / "classifier.pt")
    return folder / "classifier.pt", vit


def photos(folder: Path) -> Path:
    folder.mkdir()
    for i in range(2):
        Image.new("RGB", (16, 16), (90 * i, 120, 200 - 60 * i)).save(folder / f"p{i}.png")
    return folder


def capture_figures(monkeypatch) -> dict[str, object]:
    """{file stem: figure} of every figure `vit.tools.plots.save` writes from now on."""
    figures, real_save = {}, plots.save

    def grab(fig, path):
        figures[Path(path).stem] = fig
        return real_save(fig, path)

    monkeypatch.setattr(plots, "save", grab)
    return figures


def drawn_heat(ax) -> torch.Tensor:
    """The heat map `views.overlay` drew over the image of `ax` (its second image)."""
    return torch.as_tensor(ax.get_images()[1].get_array().data)


@pytest.mark.parametrize("arch", ["vit", "linear_probe"])
def test_avg_pool_classifier_attention_follows_what_its_head_reads(tmp_path, monkeypatch, arch):
    """An avg-pool classifier's attention figures showed (and were titled) [CLS], a token its head never reads."""
    ckpt, vit = write_classifier(tmp_path / "ft", arch)
    assert load_checkpoint(str(ckpt)).pool == "avg"
    figures = capture_figures(monkeypatch)
    visualize(str(ckpt), [str(photos(tmp_path / "photos"))], tmp_path / "out", num_images=2)
    from vit.data.augment import normalize
    from vit.data.decode import decode_image

    images = torch.stack([torch.from_numpy(decode_image(p.read_bytes(), str(p), image_size=16).copy()).permute(2, 0, 1)
                          for p in sorted((tmp_path / "photos").iterdir())]).float() / 255  # fmt: skip
    maps = vit.eval().attention_maps(normalize(images, MEAN, STD))
    patch_rows = maps[-1][:, :, 1:, 1:].mean(dim=2).reshape(2, 2, 4, 4)  # (B, H, G, G): the rows the pooled tokens average
    heads = figures["attention_heads"]
    title = heads._suptitle.get_text()
    assert "patch tokens' mean" in title and "avg-pool" in title, title
    ax = heads.axes[1 * 3 + 2]  # image 1, head 1 (columns: input, head 0, head 1)
    assert torch.allclose(drawn_heat(ax), upsample_maps(patch_rows[1], 16)[1], atol=1e-5)
    cls_map = upsample_maps(maps[-1][:, :, 0, 1:].reshape(2, 2, 4, 4)[1], 16)[1]
    assert not torch.allclose(drawn_heat(ax), cls_map, atol=1e-3)  # a different map from [CLS]'s, so the test tells them apart
    rollout_title = figures["attention_rollout"]._suptitle.get_text()
    assert "patch tokens' mean" in rollout_title and "[CLS])" in rollout_title, rollout_title


def test_encoder_attention_still_shows_cls_and_says_how_maps_are_scaled(tmp_path, monkeypatch):
    """The heads figure said 'each map scaled to its own max', but each map is stretched from its own min (drawn as 0)."""
    figures = capture_figures(monkeypatch)
    images = torch.rand(1, 3, 16, 16)
    attn = torch.full((1, 2, 17, 17), 1.0 / 17)
    attn[0, :, 0, 1:] = torch.linspace(0.05, 0.06, 16)  # [CLS]'s row: every patch gets at least 0.05
    views.figure_attention_heads(images, attn, tmp_path / "heads.png")
    heat = drawn_heat(figures["heads"].axes[1])
    assert heat.min() == 0 and heat.max() == 1  # the least-attended patch, at 0.05 of the attention, is drawn as none
    title = figures["heads"]._suptitle.get_text()
    assert "[CLS]" in title and "min" in title, title


def test_reconstruction_with_norm_pix_loss_unnormalises_each_patch_with_its_own_statistics():
    """A perfect per-patch-normalised prediction must come back as the original image (rows 2 and 3), the masked input
    keeps the visible patches of the original, and its label counts the visible patches the masks keep."""
    from pretrain.figures import reconstruct

    torch.manual_seed(0)
    encoder = VisionTransformer(img_size=16, patch_size=4, embed_dim=16, depth=1, num_heads=2, num_classes=0)
    mae = MaskedAutoencoder(encoder, decoder_embed_dim=16, decoder_depth=1, decoder_num_heads=2, norm_pix_loss=True).eval()
    raw = torch.rand(2, 3, 16, 16)
    x = (raw - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    real = mae.forward

    def perfect(imgs, noise=None):  # the model's masks, with the very target it is trained to predict
        loss, _, mask = real(imgs, noise=noise)
        return loss, mae.target(imgs), mask

    mae.forward = perfect
    rows, labels = reconstruct(mae, x, MEAN, STD)
    assert torch.allclose(rows[0], raw, atol=1e-5) and torch.allclose(rows[2], raw, atol=1e-4) and torch.allclose(rows[3], raw, atol=1e-4)
    shown = (rows[1] != 0.5).any(1)  # (B, H, W): pixels of visible patches (a grey 0.5 in all channels is a hidden one)
    assert torch.allclose(rows[1][shown.unsqueeze(1).expand_as(raw)], raw[shown.unsqueeze(1).expand_as(raw)], atol=1e-5)
    assert "4 of 16 patches visible" in labels[1] and int(shown[0].sum()) == 4 * 16
