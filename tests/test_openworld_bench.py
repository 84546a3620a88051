"""The research scripts run end to end in their smoke mode (generated data, small heads)."""

import json

from research import openworld_bench


def test_openworld_bench_smoke(tmp_path, capsys):
    variants = ["default", "pseudo contour", "augment", "adapt + csls-gallery", "csls-train"]
    assert openworld_bench.main(["--smoke", "--out", str(tmp_path), "--threads", "1",
                                 "--variants", *variants]) == 0
    rows = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    # every variant on both class folds and the validation classes, each with both measures
    assert sorted({(r["variant"], r["set"]) for r in rows}) == sorted(
        (v, s) for v in variants for s in ("valid", "fold0", "fold1"))
    for r in rows:
        for key in ("gen_map", "gen_p", "gen_seen", "zs_map", "zs_modes_map"):
            assert 0 <= r[key] <= 1, (key, r)
    by = {(r["variant"], r["set"]): r for r in rows}
    # the search-time correction changes the scores, not the heads: the modes alone agree
    assert by["csls-train", "fold0"]["zs_modes_map"] == by["default", "fold0"]["zs_modes_map"]
    assert "| default | folds | 2 |" in capsys.readouterr().out
