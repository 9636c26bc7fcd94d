"""`--check`: verify a converted checkpoint's files against the digests recorded when they were written; with
`--check-source`, also re-read the source and compare a random sample of its tensors with the converted ones.

Converted arrays are mapped back to HF's layout (heads re-joined, kv_b_proj re-concatenated, expert e
sliced out of the stack) independently of the builder, so a layout or storage bug shows up as a
mismatch. Kept INT4 / FP8 tensors must match bit for bit; dense ones must equal the source (dequantized
where it was quantized) cast to the stored dtype.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from convert.checkpoint import METADATA_FILE, load_item_numpy, read_metadata
from convert.errors import CheckpointError
from convert.integrity import verify_manifest
from convert.hf_draft_weights import build_draft, plan_draft
from convert.hf_weights import WeightBuilder
from convert.kimi_tensors import LinearSpec, PlainSpec, layer_prefix, target_items
from convert.safetensors_reader import CheckpointReader
from convert.stream import read_config
from convert.tokenizer_files import tokenizer_files
from model.config import TextConfig, text_config_from_dict
from model.decoder import LayerWeights
from model.eagle3 import draft_config_from_dict
from model.moe import MoEWeights
from model.quant import Fp8Weight, Int4Weight


def layer_views(cfg: TextConfig, layer: int, lw: LayerWeights) -> dict[str, object]:
    """HF tensor / module name -> the converted value in HF layout ([out, in], or a quantized container)."""
    p, a = layer_prefix(cfg, layer), layer_prefix(cfg, layer) + "self_attn."
    att = lw.attn
    v = {
        p + "input_layernorm.weight": lw.input_norm,
        p + "post_attention_layernorm.weight": lw.post_attention_norm,
        a + "kv_a_proj_with_mqa": att.kv_a_proj,
        a + "kv_a_layernorm.weight": att.kv_a_norm,
        a + "kv_b_proj": np.concatenate([np.swapaxes(att.w_uk, 1, 2), att.w_uv], axis=1).reshape(-1, att.w_uv.shape[-1]),
        a + "o_proj": att.o_proj.reshape(att.o_proj.shape[0], -1),
    }
    if att.q_a_proj is None:
        v[a + "q_proj"] = att.q_b_proj.reshape(-1, att.q_b_proj.shape[-1])
    else:
        v[a + "q_a_proj"] = att.q_a_proj
        v[a + "q_a_layernorm.weight"] = att.q_a_norm
        v[a + "q_b_proj"] = att.q_b_proj.reshape(-1, att.q_b_proj.shape[-1])
    m = p + "mlp."
    ff = lw.mlp
    if isinstance(ff, MoEWeights):
        v[m + "gate.weight"] = ff.router
        v[m + "gate.e_score_correction_bias"] = ff.router_bias
        for e in range(ff.experts.num_experts):
            for proj, w in (("gate_proj", ff.experts.gate), ("up_proj", ff.experts.up), ("down_proj", ff.experts.down)):
                v[f"{m}experts.{e}.{proj}"] = w[e]
        if ff.shared is not None:
            for proj, w in (("gate_proj", ff.shared.gate), ("up_proj", ff.shared.up), ("down_proj", ff.shared.down)):
                v[f"{m}shared_experts.{proj}"] = w
    else:
        for proj, w in (("gate_proj", ff.gate), ("up_proj", ff.up), ("down_proj", ff.down)):
            v[m + proj] = w
    return v


def item_views(cfg: TextConfig, item: str, tree) -> dict[str, object]:
    if item == "embed":
        return {f"{cfg.weight_prefix}model.embed_tokens.weight": tree}
    if item == "head":
        return {f"{cfg.weight_prefix}model.norm.weight": tree["final_norm"], f"{cfg.weight_prefix}lm_head": tree["lm_head"]}
    layer = int(re.fullmatch(r"layer_(\d+)", item).group(1))
    return layer_views(cfg, layer, tree)


def _same(got: np.ndarray, want: np.ndarray) -> bool:
    return got.shape == want.shape and got.dtype == want.dtype and np.array_equal(got.view(np.uint8), want.view(np.uint8))


def _compare_linear(spec: LinearSpec, got, builder: WeightBuilder) -> str | None:
    if isinstance(got, Int4Weight):
        want = builder.quantized(spec.module, spec.out, spec.inp)
        ok = isinstance(want, Int4Weight) and _same(got.packed, want.packed.view(np.uint32)) and _same(got.scale, want.scale)
        return None if ok else "INT4 words or scales differ from the source"
    if isinstance(got, Fp8Weight):
        want = builder.quantized(spec.module, spec.out, spec.inp)
        ok = isinstance(want, Fp8Weight) and _same(got.weight, want.weight) and _same(got.scale_inv, want.scale_inv)
        return None if ok else "FP8 bytes or block scales differ from the source"
    want = builder.dense(spec.module, spec.out, spec.inp, dtype=got.dtype)
    return None if _same(np.ascontiguousarray(got), want) else _diff(got, want)


def _diff(got: np.ndarray, want: np.ndarray) -> str:
    if got.shape != want.shape:
        return f"shape {list(got.shape)} vs source {list(want.shape)}"
    d = np.abs(got.astype(np.float64) - want.astype(np.float64))
    return f"max |converted - source| = {d.max():.3g} at {np.unravel_index(d.argmax(), d.shape)}"


def check_target(src: Path, dst: Path, raw: dict, samples: int, seed: int, log) -> int:
    cfg = text_config_from_dict(raw, str(src / "config.json"))
    reader = CheckpointReader(src)
    builder = WeightBuilder(reader, cfg)
    specs = [(item, s) for item, ss in target_items(cfg).items() for s in ss]
    rng = random.Random(seed)
    chosen = rng.sample(specs, min(samples, len(specs)))
    bad = 0
    for item in sorted({i for i, _ in chosen}):
        views = item_views(cfg, item, load_item_numpy(dst, item))
        for _, spec in (c for c in chosen if c[0] == item):
            if isinstance(spec, PlainSpec):
                got = views[spec.name]
                want = reader.get(spec.name).astype(got.dtype)
                err = None if _same(np.ascontiguousarray(got), want) else _diff(got, want)
                name = spec.name
            else:
                err = _compare_linear(spec, views[spec.module], builder)
                name = spec.module
            if err:
                bad += 1
                log(f"check: MISMATCH {name} (item {item}): {err}")
    log(f"check: {len(chosen) - bad} of {len(chosen)} sampled tensors match the source")
    return bad


def check_draft(src: Path, dst: Path, raw: dict, log) -> int:
    cfg = draft_config_from_dict(raw, str(src / "config.json"))
    reader = CheckpointReader(src)
    names = plan_draft(reader, cfg, raw)
    got = load_item_numpy(dst, "draft")
    want = build_draft(reader, cfg, names, got.fc.dtype)
    bad = 0
    for (path, g), (_, w) in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree_util.tree_flatten_with_path(want)[0]):
        if not _same(np.ascontiguousarray(g), np.ascontiguousarray(w)):
            bad += 1
            log(f"check: MISMATCH draft {jax.tree_util.keystr(path)}: {_diff(g, w)}")
    n = len(jax.tree_util.tree_leaves(got))
    log(f"check: {n - bad} of {n} draft tensors match the source")
    return bad


def check_digests(dst: Path, meta: dict, log) -> int:
    """Every file of the manifest present, of its size and SHA-256; -> the number of problems."""
    manifest = meta.get("manifest")
    if manifest is None:
        log(f"check: {dst} records no digests (converted before checkpoints carried a manifest); "
            "--check-source compares it with the source instead")
        return 1
    problems = verify_manifest(dst, manifest, full=True)
    n = len(manifest) if isinstance(manifest, dict) else 0
    # the engine reads these beside the weights (eos ids, the chat template, the tokenizer) whether or not the
    # conversion wrote them: one added later would change what a load does with no digest to show it
    unlisted = [p for p in tokenizer_files(dst) if p.name not in manifest] if isinstance(manifest, dict) else []
    for p in problems:
        log(f"check: BAD {p}")
    for p in unlisted:
        log(f"check: BAD {p}: a tokenizer, template or generation file beside the weights that the manifest does "
            "not list (added after the conversion?)")
    log(f"check: {n - len(problems)} of {n} files match their recorded SHA-256")
    return len(problems) + len(unlisted)


def check_conversion(src: str | Path, dst: str | Path, samples: int = 24, seed: int = 0,
                     log: Callable[[str], None] = print) -> int:
    """Number of problems (0: every digest matches and the sample, if any, agrees with the source).
    `samples` > 0 also compares that many source tensors (a drafter: all of them)."""
    src, dst = Path(src), Path(dst)
    meta = read_metadata(dst)
    bad = check_digests(dst, meta, log)
    if bad or samples <= 0:
        return bad
    raw = read_config(src)
    # the metadata file is not in its own manifest: the digests above vouch for everything but it
    if meta.get("kind") not in ("target", "draft"):
        raise CheckpointError(f"{dst / METADATA_FILE}: 'kind' must be 'target' or 'draft', got {meta.get('kind')!r}")
    if meta["kind"] == "draft":
        return check_draft(src, dst, raw, log)
    return check_target(src, dst, raw, samples, seed, log)
