"""The confusion figure's rows: a class with no image was a row of 0.00 (read as never right, where per_class says None),
and a class's images with non-finite logits, in no column, were left out of its row's total (its diagonal read 1.00 at
an accuracy of 0.5)."""

import contextlib
import math

import torch

from finetune.evaluate import confusion_rates, evaluate, save_confusion_matrix


def test_a_class_with_no_image_is_no_rate_and_a_row_is_a_share_of_all_the_class_images():
    confusion = torch.tensor([[3, 1, 0], [0, 0, 0], [0, 0, 2]])
    rates = confusion_rates(confusion, torch.tensor([4, 0, 4]))  # class c: 4 images, 2 of them with non-finite logits
    assert rates[0].tolist() == [0.75, 0.25, 0.0] and rates[2].tolist() == [0.0, 0.0, 0.5]
    assert all(math.isnan(v) for v in rates[1].tolist())
    assert confusion_rates(confusion)[2, 2] == 1.0  # without the counts: the row sums, as before


def test_the_stage_draws_rows_of_its_per_class_accuracies(tmp_path):
    class Nan(torch.nn.Module):
        def forward(self, x):  # class 0's images right, class 2's: one right, one NaN; no image of class 1
            logits = torch.nn.functional.one_hot(x[:, 0, 0, 0].long(), 3).float()
            logits[x[:, 0, 0, 1] > 0] = float("nan")
            return logits

    images = torch.zeros(4, 3, 2, 2)
    images[2:, 0, 0, 0] = 2
    images[3, 0, 0, 1] = 1

    class Loader:
        def epoch(self, _):
            yield images, torch.tensor([0, 0, 2, 2])

    class Acc:
        device = torch.device("cpu")
        num_processes = 1

        def reduce(self, t, reduction):
            return t

        def autocast(self):
            return contextlib.nullcontext()

    r = evaluate(Nan(), Loader(), Acc(), 3)
    assert r["per_class"] == [1.0, None, 0.5]
    rates = confusion_rates(r["confusion"], r["images"])
    assert [rates[0, 0].item(), rates[2, 2].item()] == r["per_class"][::2] and math.isnan(rates[1, 1])
    assert save_confusion_matrix(r["confusion"], ["a", "b", "c"], tmp_path / "c.png", "t", r["images"]).exists()
