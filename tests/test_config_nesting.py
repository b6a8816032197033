"""A YAML file written in the command line's dotted form (`model.name: ...`) or with a section given a value
(`model: vit_cifar_small`) is refused in one line that shows the nested form, which then loads."""

import pytest

from pretrain.config import PretrainConfig
from vit.config import load_config
from vit.errors import ConfigError


@pytest.mark.parametrize("text, nested", [
    ("model.name: vit_cifar_small\n", "model: {name: vit_cifar_small}"),
    ("model: vit_cifar_small\n", "model: {name: vit_cifar_small}"),
    ("optim.betas: [0.9, 0.99]\n", "optim: {betas: [0.9, 0.99]}"),
])  # fmt: skip
def test_the_line_shows_the_nested_form_and_that_form_loads(tmp_path, text, nested):
    (tmp_path / "wrong.yaml").write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(PretrainConfig, tmp_path / "wrong.yaml")
    assert str(e.value).endswith(f"e.g. {nested}"), str(e.value)
    (tmp_path / "right.yaml").write_text(nested + "\n")
    cfg = load_config(PretrainConfig, tmp_path / "right.yaml")
    assert cfg.model.name == "vit_cifar_small" or tuple(cfg.optim.betas) == (0.9, 0.99)


def test_other_slips_keep_their_plain_line(tmp_path):
    """No guess where none fits: a section given a number, a section without a `name`, a dotted key of no section."""
    for text, line in (("optim: 3\n", "optim must be a mapping in {}, got 3"), ("data: cifar10\n", "data must be a mapping in {}, got 'cifar10'"),
                       ("run:\n  model.name: x\n", "unknown config key 'run.model.name' in {}")):  # fmt: skip
        (tmp_path / "c.yaml").write_text(text)
        with pytest.raises(ConfigError) as e:
            load_config(PretrainConfig, tmp_path / "c.yaml")
        assert str(e.value) == line.format(tmp_path / "c.yaml")
