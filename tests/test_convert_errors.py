"""Bad input: one error line naming the file and tensor, exit status 2, and no output directory."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from convert.__main__ import main
from tests import convert_fixtures as fx
from tests.convert_fixtures import REPO


@pytest.fixture(scope="module")
def base_src(tmp_path_factory):
    """A bf16 2-layer checkpoint (1 dense + 1 MoE), sharded by save_pretrained itself."""
    root = tmp_path_factory.mktemp("base")
    model = fx.make_hf_model(5, **{**fx.CONVERT_TINY, "num_hidden_layers": 2})
    fx.round_model_to_bf16_(model)
    model.to(torch.bfloat16).save_pretrained(root, safe_serialization=True, max_shard_size="150KB")
    fx.write_tokenizer_files(root)
    assert len(list(root.glob("*.safetensors"))) >= 3
    return root


@pytest.fixture
def src(base_src, tmp_path):
    d = tmp_path / "src"
    shutil.copytree(base_src, d)
    return d


def index(src):
    return json.loads((src / "model.safetensors.index.json").read_text())


def edit_tensors(src, holder, edit):
    """Apply `edit(tensors)` to the shard holding tensor `holder` (index kept in step); -> its file name."""
    idx = index(src)
    fname = idx["weight_map"][holder]
    tensors = load_file(src / fname)
    edit(tensors)
    save_file(tensors, src / fname, metadata={"format": "pt"})
    idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if v != fname}
    idx["weight_map"].update({k: fname for k in tensors})
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    return fname


def edit_config(src, **changes):
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    (src / "config.json").write_text(json.dumps(cfg))


def convert_fails(src, tmp_path, capsys, *needles):
    dst = tmp_path / "dst"
    rc = main([str(src), str(dst), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1, err
    line = err[0]
    assert line.startswith("convert: error: "), line
    for needle in needles:
        assert needle in line, (needle, line)
    assert not dst.exists()
    return line


def test_shard_named_in_index_is_missing(src, tmp_path, capsys):
    fname = index(src)["weight_map"]["model.layers.1.mlp.gate.weight"]
    (src / fname).unlink()
    convert_fails(src, tmp_path, capsys, str(src / fname), "shard named in model.safetensors.index.json is missing", "holds '")


def test_truncated_safetensors_file(src, tmp_path, capsys):
    fname = index(src)["weight_map"]["model.layers.1.mlp.gate.weight"]
    data = (src / fname).read_bytes()
    (src / fname).write_bytes(data[:-100])
    convert_fails(src, tmp_path, capsys, str(src / fname), "truncated safetensors file", "tensor '")


def test_shape_mismatch(src, tmp_path, capsys):
    name = "model.layers.1.self_attn.kv_a_layernorm.weight"
    fname = edit_tensors(src, name, lambda t: t.__setitem__(name, torch.ones(16, dtype=torch.bfloat16)))
    convert_fails(src, tmp_path, capsys, str(src / fname), f"'{name}'", "has shape [16], config.json expects [32]")


def test_dtype_mismatch(src, tmp_path, capsys):
    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    fname = edit_tensors(src, name, lambda t: t.__setitem__(name, t[name].to(torch.int32)))
    convert_fails(src, tmp_path, capsys, str(src / fname), f"'{name}'", "has dtype int32")


def test_unknown_tensor(src, tmp_path, capsys):
    name = "model.layers.1.self_attn.rotary_emb.inv_freq"
    fname = edit_tensors(src, "model.layers.1.mlp.gate.weight", lambda t: t.__setitem__(name, torch.ones(4)))
    convert_fails(src, tmp_path, capsys, str(src / fname), f"'{name}'", "is unknown")


def test_missing_tensor(src, tmp_path, capsys):
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    edit_tensors(src, name, lambda t: t.pop(name))
    convert_fails(src, tmp_path, capsys, "model.safetensors.index.json", f"missing tensor '{name}'")


@pytest.mark.parametrize("quant, needle", [
    ({"quant_method": "gptq", "bits": 4}, "unsupported quantization_config.quant_method='gptq'"),
    ({**fx.k2_thinking_quantization_config(), "format": "int-quantized"}, "unsupported quantization_config.format"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "unsupported quantization_config.fmt"),
])
def test_unsupported_quantization_method(src, tmp_path, capsys, quant, needle):
    edit_config(src, quantization_config=quant)
    convert_fails(src, tmp_path, capsys, str(src / "config.json"), needle)


def test_config_has_fewer_layers_than_weights(src, tmp_path, capsys):
    edit_config(src, num_hidden_layers=1)
    convert_fails(src, tmp_path, capsys, "model.layers.1.", "but config.json num_hidden_layers=1", ".safetensors")


def test_config_has_more_layers_than_weights(src, tmp_path, capsys):
    edit_config(src, num_hidden_layers=3)
    convert_fails(src, tmp_path, capsys, "missing tensor 'model.layers.2.", "num_hidden_layers=3 but the weights hold 2 layers")


def test_config_has_fewer_experts_than_weights(src, tmp_path, capsys):
    edit_config(src, n_routed_experts=8)
    convert_fails(src, tmp_path, capsys, "'model.layers.1.mlp.gate.weight' has shape [16, 64], config.json expects [8, 64]")


def test_fp8_weights_but_config_declares_no_quantization(src, tmp_path, capsys):
    name = "model.layers.1.mlp.experts.0.gate_proj"

    def to_fp8(t):
        t[name + ".weight"] = t[name + ".weight"].to(torch.float8_e4m3fn)
        t[name + ".weight_scale_inv"] = torch.ones(1, 1)

    fname = edit_tensors(src, name + ".weight", to_fp8)
    convert_fails(src, tmp_path, capsys, str(src / fname), f"'{name}.weight_scale_inv'", "declares no quantization")


def test_int4_config_but_dense_experts(src, tmp_path, capsys):
    edit_config(src, quantization_config=fx.k2_thinking_quantization_config())
    convert_fails(src, tmp_path, capsys, "model.layers.1.mlp.experts.0.gate_proj.weight",
                  "quantizes this module to INT4 (it is not in the ignore list)")


def test_fp8_experts_with_edge_blocks_keep_their_block_size(tmp_path, capsys):
    """moe_intermediate_size 24 is not a multiple of the 16x16 FP8 block: kept FP8 experts carry their block
    size (not inferred from the scale grid), so they dequantize exactly like an --experts bf16 conversion."""
    import jax.numpy as jnp
    import numpy as np

    from convert.checkpoint import load_target
    from model.quant import Fp8Weight, dequantize

    src = tmp_path / "src"
    src.mkdir()
    fx.fp8_checkpoint(src, tmp_path / "scratch", num_hidden_layers=2, moe_intermediate_size=24)
    capsys.readouterr()  # the writer's own progress output
    assert main([str(src), str(tmp_path / "keep"), "--no-progress", "--dtype", "float32", "--check"]) == 0
    assert main([str(src), str(tmp_path / "deq"), "--no-progress", "--dtype", "float32", "--experts", "bf16"]) == 0
    _, kept = load_target(tmp_path / "keep", dtype="stored")
    _, deq = load_target(tmp_path / "deq", dtype="stored")
    for proj in ("gate", "up", "down"):
        k = getattr(kept.layers[1].mlp.experts, proj)
        assert isinstance(k, Fp8Weight) and k.block_size == (16, 16)
        np.testing.assert_array_equal(np.asarray(dequantize(k, jnp.float32)),
                                      np.asarray(getattr(deq.layers[1].mlp.experts, proj), np.float32))


def test_mtp_layer_is_skipped_with_one_line(src, tmp_path, capsys):
    mtp = "model.layers.2."
    edit_tensors(src, "model.layers.1.mlp.gate.weight", lambda t: t.update({mtp + "eh_proj.weight": torch.ones(64, 128), mtp + "enorm.weight": torch.ones(64)}))
    rc = main([str(src), str(tmp_path / "dst"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 0
    assert sum("skipping 2 multi-token-prediction tensors (model.layers.2.*)" in line for line in err.splitlines()) == 1


def test_existing_destination_is_not_replaced(src, tmp_path, capsys):
    (tmp_path / "dst").mkdir()
    rc = main([str(src), str(tmp_path / "dst"), "--no-progress"])
    assert rc == 2 and "already exists (pass --overwrite" in capsys.readouterr().err


def test_drafter_with_inconsistent_t2d(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    fx.drafter_checkpoint(src)
    tensors = load_file(src / "model.safetensors")
    tensors["t2d"] = torch.roll(tensors["t2d"], 1)
    save_file(tensors, src / "model.safetensors")
    convert_fails(src, tmp_path, capsys, str(src / "model.safetensors"), "tensor 't2d' disagrees with 'd2t'")


def test_drafter_with_unknown_tensor(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    fx.drafter_checkpoint(src)
    tensors = load_file(src / "model.safetensors")
    tensors["fc_norm.weight"] = torch.ones(64)
    save_file(tensors, src / "model.safetensors")
    convert_fails(src, tmp_path, capsys, str(src / "model.safetensors"), "'fc_norm.weight' is unknown")


def test_cli_exit_status_and_single_line(src, tmp_path):
    """The real entry point, in a subprocess: status 2 and exactly one stderr line."""
    fname = index(src)["weight_map"]["model.embed_tokens.weight"]
    (src / fname).unlink()
    r = subprocess.run([sys.executable, "-m", "convert", str(src), str(tmp_path / "dst")], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("convert: error: ") and fname in lines[0], r.stderr
    assert not (tmp_path / "dst").exists()
