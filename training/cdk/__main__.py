"""python -m training.cdk --data DIR [--split ...] [--backbone ...] [--method ...]
[--preset cpu|paper] [--seed S] [--out DIR] (every Config field is a dashed flag)."""

from __future__ import annotations

import sys

from training import cli
from training.allocator import tune_allocator

from .config import PRESET_REASONS, parse_args
from .run import run


def main(argv: list[str] | None = None) -> int:
    return cli.main(_main, argv)


def _main(argv: list[str]) -> int:
    tune_allocator()
    cfg = parse_args(argv)
    chosen = "--preset" in argv or any(a.startswith("--preset=") for a in argv)
    print(f"preset {cfg.preset} ({'chosen' if chosen else 'no --preset given'}): "
          f"{PRESET_REASONS[cfg.preset]}", flush=True)
    m = run(cfg, say=lambda line: print(line, flush=True))
    if m:
        dims = " ".join(f"{d}:{v:.3f}" for d, v in m["map_by_dims"].items())
        if m["note"]:
            print(m["note"])
        where = f"{cfg.split} {m['evaluated_on']} classes"
        print(f"{cfg.method} on {where}: mAP@all {m['map_all']:.4f}  "
              f"P@{m['k']} {m['precision_at_k']:.4f}  (raw {cfg.backbone} cosine: mAP@all "
              f"{m['raw_backbone_cosine']['map_all']:.4f}, P@{m['k']} "
              f"{m['raw_backbone_cosine']['precision_at_k']:.4f})")
        print(f"mAP by d most significant modes: {dims}")
        if m["valid"] is not None:  # the numbers to choose settings by
            print(f"validation classes: mAP@all {m['valid']['map_all']:.4f}  "
                  f"P@{m['k']} {m['valid']['precision_at_k']:.4f}")
        if m["smoothed"] is not None:  # what an index of these photos returns
            sm, c = m["smoothed"], m["smoothed"]["config"]
            print(f"against the smoothed gallery (k={c['k']}, weight {c['weight']}, "
                  f"{c['rounds']} rounds): {m['evaluated_on']} mAP@all {sm['map_all']:.4f}  "
                  f"P@{m['k']} {sm['precision_at_k']:.4f}" + (
                      "" if m["valid"] is None else
                      f"; validation mAP@all {m['valid']['smoothed']['map_all']:.4f}"))
        sv, e = m["service"], m["service"]["expansion"]
        how = (f"each query expanded with its {e['n']} best photos, weight {e['weight']}"
               if e else "no query expansion")
        print(f"as the service answers ({how}): {m['evaluated_on']} mAP@all "
              f"{sv['map_all']:.4f}  P@{m['k']} {sv['precision_at_k']:.4f}" + (
                  "" if m["valid"] is None else
                  f"; validation mAP@all {m['valid']['service']['map_all']:.4f}"))
        print(f"wrote {cfg.out}/checkpoint.pt, {cfg.out}/metrics.json and the model bundle "
              f"{cfg.out}/model; index photos with it: python -m index.build --model "
              f"{cfg.out}/model --photos PHOTOS --out runs/index")
    return 0


if __name__ == "__main__":
    sys.exit(main())
