"""Hostile tests of the encoder, round 8: token indices of another batch, a negative class count, a positional table
without a patch position; the numbers held to timm's own modules."""

from functools import partial

import pytest
import timm
import torch

from vit.errors import CheckpointError
from vit.models.encoder import Attention, Block, VisionTransformer
from vit.models.pos_embed import resample_pos_embed
from vit.store.checkpoint import load_timm_weights

TINY = {"img_size": 16, "patch_size": 4, "embed_dim": 32, "depth": 1, "num_heads": 2, "num_classes": 0}


def test_an_index_of_another_batch_is_refused_not_gathered_from_the_first_images():
    # torch.gather takes an index with fewer rows than the input: a (1, K) index for 4 images embedded the first image
    # alone (features of batch 1), and a block's (1, M) query index mixed one image's tokens into all four.
    torch.manual_seed(0)
    model = VisionTransformer(**TINY).eval()
    x = torch.randn(4, 3, 16, 16)
    with pytest.raises(ValueError, match=r"index has shape \(1, 5\), expected \(batch, tokens\) with batch = 4"):
        model.forward_features(x, torch.arange(5).unsqueeze(0))
    tokens = torch.randn(4, 9, 32)
    block = Block(32, 2).eval()
    with pytest.raises(ValueError, match=r"index has shape \(1, 4\), expected \(batch, tokens\) with batch = 4"):
        block(tokens, index=torch.tensor([[0, 1, 2, 3]]))
    with pytest.raises(ValueError, match=r"index has shape \(4,\)"):
        Attention(32, 2)(tokens, index=torch.tensor([0, 1, 2, 3]))
    # An index of the batch still gives timm's block output at those tokens.
    theirs = timm.models.vision_transformer.Block(32, 2, qkv_bias=True, norm_layer=partial(torch.nn.LayerNorm, eps=1e-6)).eval()
    theirs.load_state_dict(block.state_dict(), strict=True)
    index = torch.tensor([[8, 0], [3, 3], [1, 5], [2, 7]])
    expected = theirs(tokens).gather(1, index.unsqueeze(-1).expand(-1, -1, 32))
    torch.testing.assert_close(block(tokens, index=index), expected, rtol=1e-5, atol=1e-5)


def test_a_negative_class_count_is_refused_not_built_headless():
    # num_classes=-1 built nn.Identity for the head: the "logits" were the pooled features (B, D), and training ran on them.
    with pytest.raises(ValueError, match=r"num_classes must be 0 or more, got -1"):
        VisionTransformer(**{**TINY, "num_classes": -1})
    assert VisionTransformer(**TINY)(torch.randn(2, 3, 16, 16)).shape == (2, 32)  # 0 is headless, as asked


def test_a_table_without_a_patch_position_is_refused_as_a_checkpoint_error():
    # A table of [CLS] alone read as a 0x0 grid, and the interpolation's RuntimeError escaped the CheckpointError that
    # names a table that does not fit: timm's class_token=False ViT of one patch has pos_embed (1, 1, D).
    with pytest.raises(ValueError, match=r"positional embedding \(1, 1, 8\) has no patch position after its 1 prefix rows"):
        resample_pos_embed(torch.randn(1, 1, 8), 4)
    theirs = timm.models.vision_transformer.VisionTransformer(
        img_size=4, patch_size=4, embed_dim=32, depth=1, num_heads=2, num_classes=0, class_token=False, global_pool="avg", fc_norm=False
    )
    assert theirs.pos_embed.shape == (1, 1, 32)
    with pytest.raises(CheckpointError, match=r"their pos_embed \(1, 1, 32\) is not a \[CLS\] row followed by a square patch grid"):
        load_timm_weights(VisionTransformer(**TINY), theirs.state_dict())
