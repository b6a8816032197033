"""Hostile checks of the memory loader's crop and eval resize (vit.data.augment) against torchvision: crops whose box
lies inside the image, and stored images that are not square."""

import pytest
import torch
import torchvision.transforms as T
import torchvision.transforms.functional as TF

from vit.data.augment import BatchLoader, random_resized_crop_flip
from vit.data.splits import ImageSet

MEAN, STD = (0.4, 0.5, 0.6), (0.2, 0.25, 0.3)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# (top, left, h, w, out): upscaled both ways, up one way and down the other, downscaled, at the image's corner
BOXES = [(7, 5, 17, 19, 32), (2, 3, 14, 10, 12), (4, 6, 20, 24, 8), (0, 0, 9, 9, 20), (23, 19, 9, 13, 16)]


@pytest.mark.parametrize("top, left, h, w, out", BOXES)
@pytest.mark.parametrize("flip", [False, True])
def test_a_crop_inside_the_image_reads_only_its_own_box_as_torchvision_resized_crop(top, left, h, w, out, flip):
    # torchvision crops, then resizes: the crop's border rows and columns repeat its own edge pixels. One grid_sample over
    # the whole image read the neighbours beyond an upscaled box instead, up to 0.29 away on its outer pixels. (The
    # loader does not antialias a downscaled crop, as documented, so the reference does not either.)
    x = torch.rand(2, 3, 32, 32, generator=gen(1))
    box = torch.tensor([[float(left), float(top), float(w), float(h)]]).repeat(2, 1)  # (x0, y0, w, h)
    ours = random_resized_crop_flip(x, box, torch.tensor([flip, flip]), out)
    for i in range(2):
        expected = TF.resized_crop(x[i], top, left, h, w, [out, out], antialias=False)
        torch.testing.assert_close(ours[i], TF.hflip(expected) if flip else expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("height, width, out", [(12, 20, 8), (20, 12, 8), (7, 5, 8), (9, 31, 8), (10, 16, 10)])
def test_eval_batches_of_images_of_another_shape_are_torchvision_resize_then_centre_crop(height, width, out):
    # The memory loader keeps same-sized images of another aspect as they are stored (data.loader=memory without
    # data.image_size); eval squashed them to the square, where torchvision's Resize(S) + CenterCrop(S) keeps the shape.
    images = torch.randint(0, 256, (5, 3, height, width), dtype=torch.uint8, generator=gen(3))
    loader = BatchLoader(ImageSet(images, torch.arange(5), ["x"]), 2, device="cpu", mean=MEAN, std=STD, out_size=out, train=False)
    got = torch.cat([x for x, _ in loader.epoch(0)])
    assert got.shape == (5, 3, out, out)
    reference = T.Compose([T.Resize(out, antialias=True), T.CenterCrop(out), T.Normalize(MEAN, STD)])
    expected = torch.stack([reference(img.float() / 255) for img in images])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
