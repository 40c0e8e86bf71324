"""Checkpoint errors and the native format."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.weights import CheckpointError, load_model, save_native
from tests.factories import tiny_model, write_llama


def test_native_roundtrip_for_configs_hf_cannot_express(tmp_path: Path) -> None:
    model = tiny_model(position="alibi", norm_placement="post", norm="layernorm", ffn="relu")
    save_native(model, tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.cfg == model.cfg
    tokens = torch.randint(0, 97, (20,))
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model(tokens))


def test_missing_directory_and_files(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="model directory not found"):
        load_model(tmp_path / "nope")
    with pytest.raises(CheckpointError, match=r"config\.json: file not found"):
        load_model(tmp_path)
    write_llama(tmp_path, tied=True)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(tmp_path)


def test_unknown_architecture(tmp_path: Path) -> None:
    write_llama(tmp_path, tied=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unknown architecture 'FalconForCausalLM'"):
        load_model(tmp_path)


def test_wrong_shape_names_the_tensor(tmp_path: Path) -> None:
    write_llama(tmp_path, tied=True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(7, 64)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        CheckpointError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*\(7, 64\)"
    ):
        load_model(tmp_path)


def test_missing_tensor_and_corrupt_file(tmp_path: Path) -> None:
    write_llama(tmp_path, tied=False)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="no tensor 'lm_head.weight'"):
        load_model(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(tmp_path)
