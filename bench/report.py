"""Write a benchmark result as JSON (everything) and a markdown table (what a note quotes)."""

from __future__ import annotations

import datetime
import glob
import json
import os
from pathlib import Path
from typing import NamedTuple

import numpy as np


class RunStamp(NamedTuple):
    fields: dict  # what a result opens with: device, platform, jax, date (UTC, to the second)
    suffix: str  # what its files are named by: <platform>-<YYYYmmdd-HHMM>
    device: object  # the jax device the run measures


def run_stamp() -> RunStamp:
    """The device and the moment a bench's run starts, as its result and its file names carry them."""
    import jax  # here, not above: a bench sets its XLA environment before jax is first imported

    dev = jax.devices()[0]
    now = datetime.datetime.now(datetime.timezone.utc)
    fields = dict(device=dev.device_kind, platform=dev.platform, jax=jax.__version__,
                  date=now.isoformat(timespec="seconds"))
    return RunStamp(fields, f"{dev.platform}-{now.strftime('%Y%m%d-%H%M')}", dev)


def fmt(x, digits=3) -> str:
    """A number for a table cell; "-" where it is missing."""
    return "-" if x is None else f"{x:.{digits}f}"


def _loop_cells(r: dict) -> str:
    """A row's device-loop cells: per step (the slope), the loop call's fixed cost, the N-step loop / N."""
    return " | ".join(fmt(r.get(k)) for k in ("device_loop_ms", "device_loop_fixed_ms", "device_loop_chained_ms"))


def _decode_ms(steps, batch, context, path, key="median_ms"):
    for r in steps:
        if (r["batch"], r["context"], r["tokens"], r.get("moe_path")) == (batch, context, 1, path):
            return r.get(key)
    return None


def _short(c: dict) -> str:
    if c.get("variant") in ("wgmma", "grouped"):
        down_st = c.get("down_stages") or c["stages"]
        stages = f"st{c['stages']}" + (f"/{down_st}" if down_st != c["stages"] else "")
        f_splits = c.get("down_k_splits", 1)
        return (f"{c['variant']} {stages} gate_up/{c['gate_up_splits']} down/{c['down_splits']}"
                + (f" F/{f_splits}" if f_splits > 1 else "") + (" h-before" if c.get("permute_h") == "before" else ""))
    slots = f"/{c['slots']}" if c.get("variant") == "gemv" else ""
    return f"{c.get('variant', 'mma')}{slots} {c['block_f']}/{c['block_h']}/{c['block_k']} w{c['num_warps']} s{c['down_splits']}"


def _kernel_configs(by_tokens: dict) -> str:
    return (" (" + ", ".join(f"{t}: {_short(c)}" for t, c in by_tokens.items()) + ")") if by_tokens else ""


def _routing(result: dict) -> str:
    routings = (result.get("args") or {}).get("routing", ["model"])
    routings = [routings] if isinstance(routings, str) else routings
    return ", ".join("the random model's router" if r == "model" else f"set by bench, {r}" for r in routings) + (
        " (bench.routes; rows say which)" if len(routings) > 1 else "")


def markdown(result: dict) -> str:
    lines = [
        f"# Step benchmark: {result['device']}, jax {result['jax']}, {result['date']}",
        "",
        f"XLA_FLAGS: `{result.get('xla_flags') or '(none)'}`",
        "",
        f"Kimi-K2.5 dims, {result['layers']} layers (layer 0 dense, the rest MoE with INT4 g32 experts; bf16 elsewhere), "
        f"lm_head {'tiny' if result['tiny'] else '163840'} rows, random weights. MoE path: {result.get('moe_path')}"
        f"{_kernel_configs(result.get('kernel_config') or {})}. Routing of the steps: {_routing(result)}.",
        f"Copy bandwidth measured in this run (XLA elementwise, read + write): {fmt(result.get('copy_tbs'), 2)} TB/s; "
        f"read bandwidth (XLA reduction, reads only): {fmt(result.get('read_tbs'), 2)} TB/s. "
        "Floors: bytes that must be moved / 4.3 TB/s and / the copy bandwidth. Times: median of device-synchronised "
        "steps after warm-up; 'queued' = mean per step with steps queued back to back; 'device loop' = per step "
        "inside one jitted loop, each step fed the previous step's argmax tokens, as the slope between loops of N and "
        "3N steps ('loop fixed' = what one loop call costs beyond its steps; 'loop / N' = the N-step loop's time / N, "
        "the device-loop figure of runs 1-15; bench.timing.device_loop_ms).",
        "",
    ]
    moe = result.get("moe_layer")
    if moe:
        lines += ["## MoE layer alone (routed experts of one layer; a call = (chain of 60 calls - chain of 20) / 40, "
                  "each chain one device loop of calls fed the last output: bench.moe_layer.per_call_ms)", "",
                  "| T | unique experts | MB | floor 4.3 TB/s (us) | Pallas kernel (us) | variant | x floor | "
                  "XLA reference (us) | x floor | kernel rel. err |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in moe["rows"]:
            lines.append(
                f"| {r['tokens']} | {r['unique_experts']} | {r['bytes'] / 1e6:.1f} | {r['floor_ms_4p3'] * 1e3:.1f} | "
                f"{fmt(r.get('kernel_ms', None) and r['kernel_ms'] * 1e3, 1)} | {r.get('kernel_variant', '-')}{'/' + r['kernel_slots'] if r.get('kernel_variant') == 'gemv' else ''} | {fmt(r.get('kernel_ratio_4p3'), 2)} | "
                f"{r['reference_ms'] * 1e3:.1f} | {r['reference_ms'] / r['floor_ms_4p3']:.2f} | {fmt(r.get('kernel_rel_err'), 4)} |")
        blocks = [r for r in moe["rows"] if r.get("block_ms")]
        if blocks:
            lines += ["", "The whole MoE block (router, routed experts, shared expert: `model.moe.moe`, what a decoder "
                      "layer calls), timed the same way; floor = router + shared expert + the unique routed experts:", "",
                      "| T | MB | floor 4.3 TB/s (us) | block (us) | x floor |", "|---|---|---|---|---|"]
            lines += [f"| {r['tokens']} | {r['block_bytes'] / 1e6:.1f} | {r['block_floor_ms_4p3'] * 1e3:.1f} | "
                      f"{r['block_ms'] * 1e3:.1f} | {r['block_ratio_4p3']:.2f} |" for r in blocks]
        lines += ["", "Tile sweep (ms per layer call): " + "; ".join(
            f"cfg{i} {_short(s['config'])}: "
            f"{'/'.join(fmt(s.get(k, {}).get('ms'), 4) for k in sorted(s) if k.startswith('T'))}"
            for i, s in moe["sweep"].items()), ""]
    bf16 = result.get("moe_layer_bf16")
    if bf16:
        lines += ["bf16 experts (kernel variant, 64-expert subset): " + "; ".join(
            f"T={r['tokens']}: {fmt(r.get('kernel_ms') and r['kernel_ms'] * 1e3, 1)} us vs floor {r['floor_ms_4p3'] * 1e3:.1f} us"
            f" (x{fmt(r.get('kernel_ratio_4p3'), 2)}), reference {fmt(r.get('reference_ms') and r['reference_ms'] * 1e3, 1)} us,"
            f" rel. err {fmt(r.get('kernel_rel_err'), 4)}" for r in bf16), ""]
    steps = result.get("steps") or []
    if steps:
        lines += ["## Target forward steps (decode T=1, verify T>1)", "",
                  "| B | context | T | MoE path | routing | median ms | queued ms | device loop ms | loop fixed ms | loop / N ms | "
                  "unique experts / layer | GB | floor 4.3 (ms) | x floor | loop x floor | floor copy (ms) | x copy floor | "
                  "/ decode |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in steps:
            dec = _decode_ms(steps, r["batch"], r["context"], r.get("moe_path"))
            lines.append(
                f"| {r['batch']} | {r['context']} | {r['tokens']} | {r.get('moe_path')} | {r.get('routing', 'model')} | "
                f"{r['median_ms']:.3f} | "
                f"{r['queued_mean_ms']:.3f} | {_loop_cells(r)} | {np.mean(r['unique_experts']):.1f} | "
                f"{r['bytes']['total'] / 1e9:.2f} | {r['floor_ms_4p3']:.3f} | {r['ratio_4p3']:.2f} | "
                f"{fmt(r.get('device_loop_ratio_4p3'), 2)} | {r['floor_ms_copy']:.3f} | {r['ratio_copy']:.2f} | "
                f"{fmt(dec and r['median_ms'] / dec, 2)} |")
        lines.append("")
    slopes = result.get("layer_slope") or []
    if slopes:
        lines += ["## One MoE layer inside the step ((N-layer step - M-layer prefix) / (N - M): same weights, tokens, "
                  "cache; no lm_head)", "",
                  "| B | context | T | routing | layers M..N-1 | synchronised us | x floor | queued us | x floor | device loop us | "
                  "x floor | floor 4.3 (us) | MB | unique experts / layer |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        us = lambda v: fmt(v and v * 1e3, 1)  # noqa: E731
        for r in slopes:
            lines.append(
                f"| {r['batch']} | {r['context']} | {r['tokens']} | {r.get('routing', 'model')} | "
                f"{r['prefix_layers']}..{r['layers'] - 1} | "
                f"{us(r['median_ms'])} | {fmt(r['median_ratio_4p3'], 2)} | {us(r['queued_ms'])} | "
                f"{fmt(r['queued_ratio_4p3'], 2)} | {us(r['device_loop_ms'])} | {fmt(r['device_loop_ratio_4p3'], 2)} | "
                f"{r['floor_ms_4p3'] * 1e3:.1f} | {r['bytes'] / 1e6:.1f} | {np.mean(r['unique_experts']):.1f} |")
        lines.append("")
    if result.get("mesh") and steps:
        mesh = " x ".join(f"{k} {v}" for k, v in result["mesh"].items())
        n_ar = result["allreduces_per_step"]
        lines += [f"## On the mesh ({mesh})", "",
                  f"All-reduce of one [B*T, hidden] bf16 activation over 'model' (median of 20 chained in one jit): "
                  + ", ".join(f"{k} {v:.1f} us" for k, v in result["allreduce_us"].items())
                  + f". Floor per device = the step's bytes / devices / 4.3 TB/s (an ideal split: replicated pieces make "
                  f"it optimistic); with {n_ar} all-reduces per step (attention and MLP outputs per layer, the lm_head).", "",
                  "| B | context | T | median ms | floor per device (ms) | + all-reduces (ms) | x (floor per device + all-reduces) |",
                  "|---|---|---|---|---|---|---|"]
        for r in steps:
            ar = n_ar * result["allreduce_us"].get(f"T{r['tokens']}", float("nan")) / 1e3
            bound = r["floor_ms_per_device"] + ar
            lines.append(f"| {r['batch']} | {r['context']} | {r['tokens']} | {r['median_ms']:.3f} | "
                         f"{r['floor_ms_per_device']:.3f} | {ar:.3f} | {r['median_ms'] / bound:.2f} |")
        lines.append("")
    cycles = result.get("cycles") or []
    if cycles:
        lines += ["## Speculative cycles (K drafts + verify K+1 + accept + draft extend, one jit)", "",
                  "| draft | B | context | K | median ms | queued ms | device loop ms | loop fixed ms | loop / N ms | GB | "
                  "floor 4.3 (ms) | x floor | loop x floor | cycle / decode = break-even tokens per cycle | "
                  "same, device loops |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in cycles:
            path = "kernel" if _decode_ms(steps, r["batch"], r["context"], "kernel") else "reference"
            dec = _decode_ms(steps, r["batch"], r["context"], path)
            dec_loop = _decode_ms(steps, r["batch"], r["context"], path, "device_loop_ms")
            loop = r.get("device_loop_ms")
            lines.append(
                f"| {r.get('draft', 'llama')} | {r['batch']} | {r['context']} | {r['k']} | {r['median_ms']:.3f} | "
                f"{r['queued_mean_ms']:.3f} | "
                f"{_loop_cells(r)} | {r['bytes']['total'] / 1e9:.2f} | {r['floor_ms_4p3']:.3f} | {r['ratio_4p3']:.2f} | "
                f"{fmt(r.get('device_loop_ratio_4p3'), 2)} | {fmt(dec and r['median_ms'] / dec, 2)} | "
                f"{fmt(loop and dec_loop and loop / dec_loop, 2)} |")
        lines.append("")
    peer = result.get("peer")
    if peer:
        lines += ["## PyTorch peer (HF transformers DeepseekV3, eager, bf16 experts, same weights)", "", peer.get("markdown", ""), ""]
    if result.get("skipped"):
        lines += ["Skipped: " + ", ".join(result["skipped"]), ""]
    if result.get("errors"):
        lines += ["Errors:", ""] + [f"- {e[:400]}" for e in result["errors"]] + [""]
    return "\n".join(lines)


_OWN_STEMS: dict[tuple[Path, str], str] = {}  # (folder, stem a run asked for) -> the stem its files go under


def own_stem(out_dir: Path, stem: str) -> str:
    """The stem this process writes `stem`'s files under in `out_dir`: the same one for a run's later saves (a run
    cut short keeps what it measured), another (`stem-2`, ...) where files of an earlier run hold it. Stems carry
    the minute a run started, so two runs of a minute into one folder would otherwise overwrite the first's."""
    key = (Path(out_dir).absolute(), stem)
    if key not in _OWN_STEMS:
        free, n = stem, 1
        while any(Path(out_dir).glob(f"{glob.escape(free)}.*")):
            n += 1
            free = f"{stem}-{n}"
        _OWN_STEMS[key] = free
    return _OWN_STEMS[key]


def write_text_whole(path: Path, text: str) -> None:
    """`text` into `path` by a rename, so a run stopped while writing leaves the last whole save, not half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_json(result: dict, out_dir: Path, stem: str) -> Path:
    """`result` as out_dir/<own stem>.json (the labs' only output, the benches' beside their markdown); returns the
    path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{own_stem(out_dir, stem)}.json"
    write_text_whole(path, json.dumps(result, indent=1, default=str))
    return path


def write_report(result: dict, out_dir: Path, stem: str, render=markdown) -> Path:
    """`result` as out_dir/<own stem>.json and `render(result)` beside it as .md (bench.step's table by default);
    returns the JSON's path."""
    path = write_json(result, out_dir, stem)
    write_text_whole(path.with_suffix(".md"), render(result))
    return path


def publish(result: dict, out_dir: Path, stem: str, render, log, also: str = "") -> Path:
    """`write_report`, then the table on `log` and where it went (`also` names any other file written beside)."""
    path = write_report(result, out_dir, stem, render)
    log(render(result))
    log(f"wrote {path} and .md{also}")
    return path
