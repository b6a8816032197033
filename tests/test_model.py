"""The shared encoder: shapes, presets, attention implementations, timm compatibility."""

import pytest
import timm
import torch

import vit
from vit.store.checkpoint import load_timm_weights, read_encoder, save_encoder, encoder_from_checkpoint, load_encoder
from vit.errors import CheckpointError
from vit.models.encoder import PRESETS, VisionTransformer, random_masking
from vit.models.pos_embed import resample_patch_embed, resample_pos_embed, sincos_2d

SMALL = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, num_classes=5)


# vit_base alone takes seconds to build: slow, the other presets stay in the quick tier.
PRESET_PARAMS = [pytest.param(n, marks=pytest.mark.slow) if n == "vit_base" else n for n in PRESETS]


def timm_vit(**kw) -> torch.nn.Module:
    """timm's VisionTransformer in the configuration our encoder mirrors (fc_norm=False for avg pooling)."""
    kw = dict(kw)
    kw.pop("attn_impl", None)
    kw.pop("pos_embed", None)
    return timm.models.vision_transformer.VisionTransformer(fc_norm=False, **kw)


def small_preset(name):
    """Full depth/width of a preset, but at 32x32 so every preset runs quickly."""
    kw = dict(PRESETS[name])
    kw["img_size"], kw["patch_size"] = 32, 8 if name != "vit_cifar_tiny" else 4
    return kw


@pytest.mark.parametrize("name", PRESET_PARAMS)
def test_preset_shapes_through_every_stage(name):
    model = vit.create_model(name, **{k: v for k, v in small_preset(name).items() if k in ("img_size", "patch_size")}, num_classes=10)
    x = torch.randn(2, 3, 32, 32)
    n = model.num_patches
    tokens = model.embed(x)
    assert tokens.shape == (2, 1 + n, model.embed_dim)
    feats = model.forward_features(x)
    assert feats.shape == (2, 1 + n, model.embed_dim)
    assert model.forward_head(feats, pre_logits=True).shape == (2, model.embed_dim)
    assert model.forward_head(feats).shape == (2, 10)
    assert model(x).shape == (2, 10)
    maps = model.attention_maps(x)
    assert len(maps) == model.config["depth"]
    assert maps[0].shape == (2, model.config["num_heads"], 1 + n, 1 + n)


@pytest.mark.parametrize("name", PRESET_PARAMS)
def test_preset_parameter_count_matches_timm(name):
    kw = small_preset(name)
    ours = vit.VisionTransformer(**kw, num_classes=10)
    theirs = timm_vit(**kw, num_classes=10)
    assert vit.count_parameters(ours) == sum(p.numel() for p in theirs.parameters())


@pytest.mark.slow
def test_vit_base_parameter_count_is_the_papers():
    # ViT-B/16 at 224 with a 1000-class head: 86.6M parameters (86,567,656 exactly, as in timm).
    model = vit.create_model("vit_base")
    assert vit.count_parameters(model) == 86_567_656


def test_headless_encoder_returns_pooled_features():
    model = VisionTransformer(**{**SMALL, "num_classes": 0})
    assert model(torch.randn(3, 3, 32, 32)).shape == (3, 32)
    assert not any(k.startswith("head.") for k in model.state_dict())


@pytest.mark.parametrize("global_pool", ["token", "avg"])
def test_attention_implementations_agree_forward_and_backward(global_pool):
    torch.manual_seed(0)
    a = VisionTransformer(**SMALL, global_pool=global_pool, attn_impl="sdpa")
    b = VisionTransformer(**SMALL, global_pool=global_pool, attn_impl="manual")
    b.load_state_dict(a.state_dict())
    x = torch.randn(4, 3, 32, 32)
    ya, yb = a(x), b(x)
    torch.testing.assert_close(ya, yb, rtol=1e-5, atol=1e-5)
    ya.square().sum().backward()
    yb.square().sum().backward()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        if pa.requires_grad:
            # Summation order differs between the kernels: compare to the gradient's own scale
            # (cls_token's reaches ~100 here, and its small entries differ by float rounding).
            scale = pb.grad.abs().max().item()
            torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-4, atol=1e-5 * max(1.0, scale), msg=name)


def test_attention_maps_are_distributions_and_match_forward():
    torch.manual_seed(0)
    model = VisionTransformer(**SMALL).eval()
    x = torch.randn(2, 3, 32, 32)
    maps = model.attention_maps(x)
    for attn in maps:
        torch.testing.assert_close(attn.sum(-1), torch.ones(attn.shape[:-1]))
    # The attention-returning path computes the same features as the plain one.
    tokens = model.embed(x)
    for block in model.blocks:
        tokens, _ = block(tokens, return_attn=True)
    torch.testing.assert_close(model.norm(tokens), model.forward_features(x), rtol=1e-5, atol=1e-5)


def test_gradients_reach_every_trainable_parameter():
    model = VisionTransformer(**SMALL, drop_path_rate=0.1, drop_rate=0.1)
    model(torch.randn(4, 3, 32, 32)).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_sincos_pos_embed_is_fixed():
    model = VisionTransformer(**SMALL, pos_embed="sincos")
    assert not model.pos_embed.requires_grad
    torch.testing.assert_close(model.pos_embed[0], sincos_2d(32, 4))
    assert torch.all(model.pos_embed[0, 0] == 0)
    # Every patch position gets its own vector.
    assert torch.unique(model.pos_embed[0, 1:], dim=0).shape[0] == 16


def test_ids_keep_selecting_all_tokens_equals_plain_forward():
    model = VisionTransformer(**SMALL).eval()
    x = torch.randn(2, 3, 32, 32)
    ids = torch.arange(model.num_patches).expand(2, -1)
    torch.testing.assert_close(model.forward_features(x, ids), model.forward_features(x))


@pytest.mark.parametrize("rate", [0.25, 0.5, 0.75])
def test_patch_dropout_keeps_the_configured_fraction_in_training_and_is_identity_in_eval(rate):
    model = VisionTransformer(**SMALL, patch_drop_rate=rate)
    n = model.num_patches
    kept = int(n * (1 - rate))
    assert kept == timm.layers.PatchDropout(rate).train()(torch.randn(1, 1 + n, 8)).shape[1] - 1  # timm keeps as many
    x = torch.randn(8, 3, 32, 32)
    assert model.train().forward_features(x).shape == (8, 1 + kept, 32)
    # Eval: every patch, and the same numbers as an encoder without patch dropout (which has the same state_dict keys).
    plain = VisionTransformer(**SMALL).eval()
    plain.load_state_dict(model.state_dict(), strict=True)
    torch.testing.assert_close(model.eval()(x), plain(x), rtol=0, atol=0)
    assert isinstance(plain.patch_drop, torch.nn.Identity)

    # The module itself: [CLS] stays first, each sample keeps its own set of distinct patch tokens.
    tokens = torch.arange(8 * (1 + n), dtype=torch.float32).reshape(8, 1 + n, 1).expand(-1, -1, 4)  # every token unique
    out = model.patch_drop.train()(tokens)
    assert out.shape == (8, 1 + kept, 4)
    assert torch.equal(out[:, 0], tokens[:, 0])
    chosen = [set(out[b, 1:, 0].tolist()) for b in range(8)]
    assert all(len(c) == kept and c <= set(tokens[b, 1:, 0].tolist()) for b, c in enumerate(chosen))
    assert len({frozenset(c) for c in chosen}) > 1
    assert model.patch_drop.eval()(tokens) is tokens


def test_patch_dropout_keeps_at_least_one_patch_as_timm_does():
    # 4 patches at rate 0.8: int(4 * 0.2) = 0, but an average over no patch token is NaN; timm keeps one.
    model = VisionTransformer(img_size=32, patch_size=16, embed_dim=32, depth=1, num_heads=2, num_classes=3, patch_drop_rate=0.8, global_pool="avg")
    assert timm.layers.PatchDropout(0.8).train()(torch.randn(1, 1 + 4, 8)).shape[1] == 1 + 1
    x = torch.randn(2, 3, 32, 32)
    assert model.train().forward_features(x).shape == (2, 1 + 1, 32)
    assert model(x).isfinite().all()


def test_patch_dropout_runs_the_encoder_on_the_kept_patches_in_their_places():
    model = VisionTransformer(**{**SMALL, "global_pool": "avg"}, patch_drop_rate=0.5)
    x = torch.randn(4, 3, 32, 32)
    torch.manual_seed(3)
    dropped = model.train()(x)
    torch.manual_seed(3)
    ids_keep, _, _ = random_masking(4, model.num_patches, 0.5)  # the draw patch dropout makes
    torch.testing.assert_close(dropped, model.eval().forward_head(model.forward_features(x, ids_keep)))
    assert not torch.allclose(dropped, model(x))  # eval sees every patch: other logits


def test_ids_keep_subset_keeps_positions():
    model = VisionTransformer(**{**SMALL, "depth": 0}).eval()  # no blocks: tokens stay independent
    x = torch.randn(2, 3, 32, 32)
    ids = torch.tensor([[3, 0, 7], [15, 2, 9]])
    sub = model.forward_features(x, ids)
    full = model.forward_features(x)
    assert sub.shape == (2, 4, 32)
    for b in range(2):
        torch.testing.assert_close(sub[b, 1:], full[b, 1 + ids[b]])


@pytest.mark.parametrize("pos_embed", ["learned", "sincos"])
def test_the_timm_baseline_trains_the_parameters_our_encoder_trains(pos_embed):
    """finetune.arch=timm_vit runs timm's code on our weights: a fixed sin-cos table must stay fixed there too."""
    from vit.tools.reference import timm_vit as timm_baseline

    ours = VisionTransformer(**SMALL, pos_embed=pos_embed)
    theirs = timm_baseline(ours.config)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    trained = [{n for n, p in m.named_parameters() if p.requires_grad} for m in (ours, theirs)]
    assert trained[1] == trained[0]
    assert ("pos_embed" in trained[0]) == (pos_embed == "learned")


def test_the_timm_baseline_drops_out_where_our_encoder_does():
    """model.drop_rate drops after the position table, the attention projection, the MLP and before the head in our
    encoder; timm's drop_rate is the head's alone, so the baseline trained another model whenever it was set."""
    from vit.tools.reference import timm_vit as timm_baseline

    ours = VisionTransformer(**SMALL, drop_rate=0.3)
    theirs = timm_baseline(ours.config)
    dropped = [sorted(n for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and m.p > 0) for model in (ours, theirs)]
    mlp = {"mlp.drop1", "mlp.drop2"}  # timm's Mlp drops after each layer too, under the same names
    assert dropped[0] == dropped[1] and {n.split(".", 2)[-1] for n in dropped[0] if n.startswith("blocks.0.")} == {"attn.proj_drop"} | mlp


@pytest.mark.parametrize("global_pool", ["token", "avg"])
def test_timm_state_dict_round_trip_gives_equal_logits(global_pool):
    torch.manual_seed(0)
    theirs = timm_vit(**SMALL, global_pool=global_pool).eval()
    ours = VisionTransformer(**SMALL, global_pool=global_pool).eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(3, 3, 32, 32)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-6)
    # And back: our weights into a fresh timm model.
    ours2 = VisionTransformer(**SMALL, global_pool=global_pool).eval()
    theirs2 = timm_vit(**SMALL, global_pool=global_pool).eval()
    theirs2.load_state_dict(ours2.state_dict(), strict=True)
    torch.testing.assert_close(theirs2(x), ours2(x), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.forward_features(x), theirs.forward_features(x), rtol=1e-5, atol=1e-6)


def test_timm_weights_of_another_resolution_are_resampled():
    torch.manual_seed(0)
    theirs = timm_vit(img_size=64, patch_size=8, embed_dim=32, depth=2, num_heads=4, num_classes=1000)
    ours = VisionTransformer(img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=4, num_classes=10)
    missing = load_timm_weights(ours, theirs.state_dict())
    assert sorted(missing) == ["head.bias", "head.weight"]
    assert ours.pos_embed.shape == (1, 1 + 64, 32)
    # The [CLS] position is carried over untouched.
    torch.testing.assert_close(ours.pos_embed[:, 0], theirs.pos_embed[:, 0])
    torch.testing.assert_close(ours.blocks[1].mlp.fc2.weight, theirs.blocks[1].mlp.fc2.weight)


def test_resampling_matches_timms_own_resampling():
    from timm.layers import resample_abs_pos_embed
    from timm.layers import resample_patch_embed as timm_resample_patch_embed

    torch.manual_seed(0)
    w = torch.randn(8, 3, 16, 16)
    torch.testing.assert_close(resample_patch_embed(w, 4), timm_resample_patch_embed(w, [4, 4]), rtol=1e-4, atol=1e-4)
    pos = torch.randn(1, 1 + 14 * 14, 16)
    torch.testing.assert_close(resample_pos_embed(pos, 8), resample_abs_pos_embed(pos, new_size=[8, 8], num_prefix_tokens=1))


@pytest.mark.parametrize("old, new", [(14, 8), (8, 14), (7, 16)])
def test_pos_embed_resampling_matches_timms_up_and_down(old, new):
    # timm antialiases its bicubic resize either way; upsampling without it uses another kernel (0.3 apart here).
    from timm.layers import resample_abs_pos_embed

    torch.manual_seed(0)
    pos = torch.randn(1, 1 + old * old, 16)
    expected = resample_abs_pos_embed(pos, new_size=[new, new], num_prefix_tokens=1)
    torch.testing.assert_close(resample_pos_embed(pos, new), expected)


def test_patch_embed_resampling_preserves_response_to_resized_patches():
    torch.manual_seed(0)
    w = torch.randn(6, 3, 8, 8, dtype=torch.float64)
    w4 = resample_patch_embed(w, 4)
    # A smooth patch (bilinear upsample of a 4x4 one) seen at 8x8 by w and at 4x4 by w4.
    small = torch.randn(1, 3, 4, 4, dtype=torch.float64)
    big = torch.nn.functional.interpolate(small, size=(8, 8), mode="bilinear", align_corners=False)
    down = torch.nn.functional.interpolate(big, size=(4, 4), mode="bilinear", align_corners=False, antialias=True)
    out_big = (w * big).sum(dim=(1, 2, 3))
    out_small = (w4 * down).sum(dim=(1, 2, 3))
    plain = torch.nn.functional.interpolate(w, size=(4, 4), mode="bilinear", align_corners=False, antialias=True)
    # Better than naive kernel interpolation by a wide margin.
    err = (out_big - out_small).abs().mean()
    naive_err = (out_big - (plain * down).sum(dim=(1, 2, 3))).abs().mean()
    assert err < 0.5 * naive_err


def test_encoder_checkpoint_round_trip(tmp_path):
    model = VisionTransformer(**SMALL)
    save_encoder(model, tmp_path / "encoder.pt", step=7)
    payload = torch.load(tmp_path / "encoder.pt", weights_only=True)
    assert payload["step"] == 7 and payload["config"]["num_classes"] == 0
    loaded = encoder_from_checkpoint(tmp_path / "encoder.pt")
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(loaded.forward_features(x), model.eval().forward_features(x))
    # A classifier with a new head takes the same file; only the head is new.
    clf = VisionTransformer(**{**SMALL, "num_classes": 3})
    load_encoder(clf, tmp_path / "encoder.pt")


def test_mismatched_encoder_checkpoint_is_refused_naming_fields(tmp_path):
    save_encoder(VisionTransformer(**SMALL), tmp_path / "encoder.pt")
    other = VisionTransformer(**{**SMALL, "depth": 3, "embed_dim": 64})
    with pytest.raises(CheckpointError, match=r"depth: 2 != 3.*embed_dim|embed_dim.*depth"):
        load_encoder(other, tmp_path / "encoder.pt")


def test_non_checkpoint_file_is_refused(tmp_path):
    bad = tmp_path / "encoder.pt"
    bad.write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match="encoder.pt"):
        read_encoder(bad)


@pytest.mark.parametrize("impl", ["sdpa", "manual"])
def test_block_with_query_index_equals_the_full_block_at_those_tokens(impl):
    from vit.models.encoder import Block

    torch.manual_seed(0)
    block = Block(32, 4, attn_impl=impl).eval()
    x = torch.randn(3, 17, 32)
    index = torch.tensor([[1, 5, 16], [0, 2, 3], [9, 8, 7]])
    full = block(x)
    part = block(x, index=index)
    torch.testing.assert_close(part, torch.gather(full, 1, index.unsqueeze(-1).expand(-1, -1, 32)), rtol=1e-5, atol=1e-5)


def test_patch_embedding_of_kept_patches_equals_the_conv():
    torch.manual_seed(0)
    model = VisionTransformer(**SMALL)
    x = torch.randn(2, 3, 32, 32)
    ids = torch.tensor([[0, 5, 15], [3, 2, 1]])
    full = model.patch_embed(x)  # the Conv2d path
    torch.testing.assert_close(model.patch_embed(x, ids), torch.gather(full, 1, ids.unsqueeze(-1).expand(-1, -1, 32)), rtol=1e-5, atol=1e-5)


def test_sincos_pretrained_encoder_fine_tunes_with_a_learned_table_starting_from_it(tmp_path):
    save_encoder(VisionTransformer(**{**SMALL, "pos_embed": "sincos"}), tmp_path / "encoder.pt")
    clf = VisionTransformer(**SMALL, pos_embed="learned")
    load_encoder(clf, tmp_path / "encoder.pt")
    assert clf.pos_embed.requires_grad
    torch.testing.assert_close(clf.pos_embed[0], sincos_2d(32, 4))


def test_a_learned_table_is_refused_by_a_model_with_a_fixed_sincos_one(tmp_path):
    # It loaded into the frozen parameter: the run said sin-cos and trained with the checkpoint's learned table, fixed.
    save_encoder(VisionTransformer(**SMALL, pos_embed="learned"), tmp_path / "encoder.pt")
    for img_size in (32, 64):  # as it is, and resampled to another patch grid
        clf = VisionTransformer(**{**SMALL, "img_size": img_size}, pos_embed="sincos")
        with pytest.raises(CheckpointError, match=r"holds a learned positional table: model.pos_embed=sincos would load it frozen"):
            load_encoder(clf, tmp_path / "encoder.pt")
    save_encoder(VisionTransformer(**SMALL, pos_embed="sincos"), tmp_path / "encoder.pt")
    load_encoder(VisionTransformer(**SMALL, pos_embed="sincos"), tmp_path / "encoder.pt")


def test_an_mlp_ratio_that_leaves_no_hidden_unit_is_refused():
    # int(32 * 0.01) = 0: every block's MLP was a Linear of width 0, and the run trained without one, unsaid.
    with pytest.raises(ValueError, match=r"mlp_ratio=0.01 gives the MLP no hidden unit at embed_dim=32"):
        VisionTransformer(**{**SMALL, "mlp_ratio": 0.01})
    assert VisionTransformer(**{**SMALL, "mlp_ratio": 0.05}).blocks[0].mlp.fc1.out_features == 1
