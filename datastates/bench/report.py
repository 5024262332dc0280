"""The report: medians, ratios against their targets (PASS/MISS), and the printed table."""


from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:

    pass

from .options import INFO_RATIOS, METHOD_LABELS, Config, Results, Target, command_line, targets_for
from .peers import _mem_total

# --- the report ----------------------------------------------------------------------------------------------


def _ratio_value(t: Target, res: Results) -> tuple[float | None, str]:
    if t.key in ("partial_bytes", "partial_bytes_changed"):
        of = "bytes_total" if t.key == "partial_bytes" else "bytes_changed"
        parts = res.extra.get("partial") or []
        vals = [p["bytes_new"] / p[of] for p in parts if p.get(of)]
        return (statistics.median(vals), "") if vals else (None, "not measured")
    if t.key == "train_lost_vs_dcp":
        lost = (res.extra.get("training") or {}).get("steps_lost", {})
        if "datastates" not in lost or "dcp" not in lost:
            return None, "skipped"
        if lost["dcp"] <= 0:
            return None, f"DCP lost {lost['dcp']:.1f} steps: no interference measured, ratio undefined"
        return max(lost["datastates"], 0.0) / lost["dcp"], ""
    num, den = res.median(t.num), res.median(t.den)
    if num is None or den is None or den <= 0:
        return None, "skipped"
    return num / den, ""


def _report(cfg: Config, res: Results, fs: str, parent: Path, t_start: float) -> dict[str, Any]:
    import torch

    methods = {}
    for key in METHOD_LABELS:
        s = res.samples.get(key)
        if s:
            med = statistics.median(s)
            methods[key] = {"median_s": med, "gb_per_s": res.nbytes[key] / med / 1e9 if med > 0 else None,
                            "bytes": res.nbytes[key], "samples_s": s,
                            "others_cpu_median": statistics.median(res.others[key])}
    ratios: dict[str, Any] = {}
    for t in targets_for(cfg):
        value, note = _ratio_value(t, res)
        ok = None if value is None else (value <= t.target if t.op == "<=" else value >= t.target)
        ratios[t.key] = {"label": t.label, "value": value, "op": t.op, "target": t.target, "pass": ok,
                         "note": note}
    info = {}
    for key, label, num, den in INFO_RATIOS:
        a, b = res.median(num), res.median(den)
        info[key] = {"label": label, "value": a / b if a is not None and b else None}
    parts = [p for p in res.extra.get("partial") or [] if p.get("bytes_changed") and p["bytes_total"]]
    if parts:  # the bytes a partial save cannot help writing: its time's floor, as a share of a full save's
        info["changed_share"] = {"label": "partial save: changed bytes / state bytes",
                                 "value": statistics.median(p["bytes_changed"] / p["bytes_total"] for p in parts)}
    full = res.extra.get("full_saves") or []
    all_others = [x for v in res.others.values() for x in v]
    return {
        "command": command_line(cfg),
        "date": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t_start)),
        "duration_s": time.time() - t_start,
        "machine": {"cpus": os.cpu_count(), "mem_bytes": _mem_total(), "platform": platform.platform(),
                    "python": platform.python_version(), "torch": torch.__version__, "fs_type": fs,
                    "dir": str(parent), "device": _device_name(cfg.device)},
        # size: --size, which a --shape run does not use (its bytes are `bytes`; it read 1 GiB for every shape)
        "config": {"size": None if cfg.shape else cfg.size, "bytes": res.extra.get("bytes"),
                   "tensors": res.extra.get("tensors"), "shape": cfg.shape, "scale": cfg.scale,
                   "dtypes": res.extra.get("dtypes"),
                   "repeats": cfg.repeats, "unchanged": cfg.unchanged, "spread": cfg.spread, "quick": cfg.quick,
                   "skip": sorted(cfg.skip), "chunk_size": cfg.chunk_size, "zstd": cfg.zstd,
                   "reuse_unchanged": cfg.reuse_unchanged},
        "methods": methods,
        "ratios": ratios,
        "info_ratios": info,
        "partial": res.extra.get("partial"),
        # Each datastates full save must write every chunk anew; below 1.0, dedup flattered the full saves.
        "full_save_new_chunks_min": min((f["chunks_new"] / f["chunks"] for f in full), default=None),
        "full_save_stored_over_raw": statistics.median(f["bytes_new"] / f["bytes_total"] for f in full)
        if full else None,
        "full_saves": full,
        "others_cpu_median": statistics.median(all_others) if all_others else None,
        "training": res.extra.get("training"),
    }


def _device_name(device: str) -> str:
    """`device`, with the GPU's name for a CUDA device ("cuda (NVIDIA H200)")."""
    import torch

    if device == "cpu":
        return device
    return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_report(rep: dict[str, Any], out: TextIO) -> None:
    """The human-readable table: methods (median s, GB/s), then each ratio with its target and PASS/MISS."""
    cfg = rep["config"]
    w = 46
    kind = f"shape {cfg['shape']} (scale {cfg['scale']:g})" if cfg.get("shape") else "fp32 tensors"
    dtypes = ",".join(cfg.get("dtypes") or [])
    print(f"\ndatastates bench: {cfg['bytes'] / 2**20:.0f} MiB in {cfg['tensors']} tensors [{dtypes}], {kind}, "
          f"{cfg['repeats']} repeats, chunk {cfg['chunk_size'] or 'default'}, zstd {cfg['zstd']}, "
          f"{rep['machine']['cpus']} CPUs, {rep['machine']['fs_type']}"
          + (f", state on {dev}" if (dev := rep["machine"].get("device", "cpu")) != "cpu" else ""), file=out)
    print(f"\n{'method':<{w}} {'median s':>9} {'GB/s':>7} {'others':>6}  samples (s)", file=out)
    # The tensors the partial save changed, as a share of the state's: `--unchanged` rounded to whole tensors (at
    # least one), so 1 of 4 tensors is 25 %, where the label said 10 %.
    parts = rep.get("partial") or []
    share = parts[0]["tensors_changed"] / cfg["tensors"] if parts and cfg.get("tensors") else 1 - cfg["unchanged"]
    for key, m in rep["methods"].items():
        label = METHOD_LABELS[key].format(changed=f"{share:.0%}")
        samples = " ".join(f"{s:.3f}" for s in m["samples_s"])
        print(f"{label:<{w}} {m['median_s']:>9.4f} {_fmt(m['gb_per_s'], '.2f'):>7} "
              f"{m['others_cpu_median']:>6.0%}  {samples}", file=out)
    print("(others: median share of the machine's CPU used by other processes during the timed step)", file=out)
    stored = rep.get("full_save_stored_over_raw")
    if cfg["zstd"] and stored is not None:
        print(f"zstd level {cfg['zstd']}: full saves stored {stored:.3f} of their raw bytes", file=out)
    tr = rep.get("training")
    if tr:
        steps = {k: [int(w["steps"]) for w in v] for k, v in tr["windows"].items()}
        print(f"\ntraining interference: step {tr['step_ms']:.1f} ms (batch {tr['batch']}), windows >= "
              f"{tr['min_window_s']:.1f} s, steps per window {steps}", file=out)
        for k, v in tr["steps_lost"].items():
            late = sum(1 for w in tr["windows"][k] if not w["complete"])
            print(f"  steps lost during one {k} save: {v:.1f}  (samples "
                  f"{', '.join(f'{x:.0f}' for x in tr['steps_lost_samples'][k])})"
                  + (f"  WARNING: {late} save(s) outlasted the window; steps lost undercounted" if late else ""),
                  file=out)
    print(f"\n{'ratio':<{w + 8}} {'value':>7} {'target':>9}  result", file=out)
    missed = []
    for r in rep["ratios"].values():
        verdict = "n/a" if r["pass"] is None else "PASS" if r["pass"] else "MISS"
        if r["pass"] is False:
            missed.append(r["label"])
        note = f"  ({r['note']})" if r["note"] else ""
        print(f"{r['label']:<{w + 8}} {_fmt(r['value'], '7.3f'):>7} {r['op'] + ' ' + format(r['target'], 'g'):>9}  "
              f"{verdict}{note}", file=out)
    for r in rep["info_ratios"].values():
        if r["value"] is not None:
            print(f"{r['label']:<{w + 8}} {r['value']:>7.3f} {'(info)':>9}", file=out)
    frac = rep.get("full_save_new_chunks_min")
    if frac is not None and frac < 1.0:
        print(f"WARNING: a datastates full save wrote only {frac:.1%} of its chunks anew: dedup helped it, so the "
              "full-save figures are optimistic", file=out)
    busy = rep.get("others_cpu_median")
    if busy is not None and busy > 0.05:
        print(f"WARNING: other processes used {busy:.0%} of the CPUs (median) during the timed steps; "
              "the figures are noisier than on a quiet machine", file=out)
    checked = sum(1 for r in rep["ratios"].values() if r["pass"] is not None)
    if missed:
        print(f"\nMISSED {len(missed)} of {checked} targets: " + "; ".join(missed), file=out)
    else:
        print(f"\nall {checked} measured targets met", file=out)


