"""A resume trims metrics.jsonl back to its state's step: a line in it that was not UTF-8 (a damaged byte) stopped the
resume with a UnicodeDecodeError traceback, where reading the records counts such a line as one bad line."""

import json

from vit.store.runs import read_metrics, trim_metrics


def test_a_line_that_is_not_utf8_is_dropped_as_a_bad_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0 / s}).encode() for s in (1, 2, 3)]
    lines[1] = lines[1].replace(b"loss", b"l\xffss")
    path.write_bytes(b"\n".join(lines) + b"\n")
    assert read_metrics(tmp_path) == ([{"step": 1, "loss": 1.0}, {"step": 3, "loss": 1 / 3}], 1)
    assert trim_metrics(path, step=2) == 2  # the damaged line and step 3's
    assert [json.loads(x) for x in path.read_text().splitlines()] == [{"step": 1, "loss": 1.0}]
