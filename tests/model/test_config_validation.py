"""Malformed config.json values fail at load time with the file, field, value and allowed range —
never deep in the forward (ZeroDivisionError), never silently truncated (64.5) or accepted (0, -1).
NaN/inf weights load with a warning naming the tensor."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from hwkv.model import ModelConfig, ModelLoadError, load_model
from hwkv.model.tiny import write_tiny_model


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("valid") / "m", arch="llama")
    return json.loads((path / "config.json").read_text())


def refused(cfg: dict, pattern: str) -> None:
    with pytest.raises(ModelLoadError, match=pattern):
        ModelConfig.from_dict(cfg, source="/m/config.json")


@pytest.mark.parametrize(("field", "value", "allowed"), [
    ("num_attention_heads", 0, "an integer >= 1"),
    ("num_attention_heads", -4, "an integer >= 1"),
    ("hidden_size", -64, "an integer >= 1"),
    ("hidden_size", True, "an integer >= 1"),
    ("hidden_size", 64.5, "an integer >= 1"),
    ("hidden_size", "64", "an integer >= 1"),
    ("vocab_size", 0, "an integer >= 1"),
    ("intermediate_size", 0, "an integer >= 1"),
    ("num_hidden_layers", 0, "an integer >= 1"),
    ("num_hidden_layers", False, "an integer >= 1"),
    ("num_key_value_heads", 0, r"an integer in \[1, 4\]"),
    ("num_key_value_heads", 8, r"an integer in \[1, 4\]"),
    ("head_dim", 0, "an integer >= 2"),
    ("head_dim", 15, "an even integer >= 2"),
    ("max_position_embeddings", 0, "an integer >= 1"),
    ("sliding_window", 0, "an integer >= 1"),
    ("rms_norm_eps", -1, "a finite number > 0"),
    ("rms_norm_eps", 0, "a finite number > 0"),
    ("rms_norm_eps", float("nan"), "a finite number > 0"),
    ("rms_norm_eps", True, "a finite number > 0"),
    ("rope_theta", 0, "a finite number > 0"),
    ("rope_theta", -10000.0, "a finite number > 0"),
    ("rope_theta", float("inf"), "a finite number > 0"),
    ("tie_word_embeddings", 1, "true or false"),
    ("attention_bias", "no", "true or false"),
    ("eos_token_id", -1, "null, an integer >= 0 or a list of them"),
    ("eos_token_id", [1, "x"], "null, an integer >= 0 or a list of them"),
    ("bos_token_id", True, "null, an integer >= 0"),
])
def test_bad_field_named_with_value_and_range(base, field, value, allowed):
    refused({**base, field: value},
            rf"^/m/config\.json: {field} = {re.escape(repr(value))} is not allowed \(allowed: {allowed}")


def test_integral_float_accepted_and_converted(base):
    cfg = ModelConfig.from_dict({**base, "hidden_size": 64.0, "num_attention_heads": 4.0})
    assert (cfg.hidden_size, cfg.num_heads) == (64, 4) and type(cfg.hidden_size) is int


def test_divisibility(base):
    refused({**base, "num_key_value_heads": 3}, r"num_attention_heads 4 is not a multiple of num_key_value_heads 3 "
                                                r"\(allowed: a divisor of 4\)")
    refused({**base, "hidden_size": 66}, r"hidden_size 66 is not a multiple of num_attention_heads 4 and no head_dim")
    assert ModelConfig.from_dict({**base, "hidden_size": 66, "head_dim": 16}).head_dim == 16  # decoupled: fine


@pytest.mark.parametrize(("scaling", "pattern"), [
    ({"rope_type": "linear", "factor": 0.5}, r"rope_scaling\.factor = 0\.5 is not allowed \(allowed: a finite "
                                             r"number >= 1\)"),
    ({"rope_type": "linear", "factor": "2"}, r"rope_scaling\.factor = '2'"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0},
     r"rope_scaling\.high_freq_factor = 1\.0 is not allowed \(allowed: a number > low_freq_factor 4\)"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 0, "high_freq_factor": 4.0},
     r"rope_scaling\.low_freq_factor = 0 is not allowed \(allowed: a finite number > 0\)"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 0}, r"rope_scaling\.original_max_position_embeddings = 0"),
    ({"rope_type": "yarn", "factor": 4.0, "beta_fast": -1}, r"rope_scaling\.beta_fast = -1"),
    ({"rope_type": "yarn", "factor": 4.0, "truncate": "yes"}, r"rope_scaling\.truncate = 'yes' is not allowed "
                                                               r"\(allowed: true or false\)"),
    ({"rope_type": 3}, r"rope_scaling\.rope_type = 3 is not allowed \(allowed: a string\)"),
    ([1, 2], r"rope_scaling = \[1, 2\] is not allowed \(allowed: an object or null\)"),
])
def test_bad_rope_scaling(base, scaling, pattern):
    refused({**base, "rope_scaling": scaling}, pattern)


def test_bad_rope_parameters_theta(base):
    refused({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 0}},
            r"rope_parameters\.rope_theta = 0 is not allowed \(allowed: a finite number > 0\)")


def test_bad_architectures_and_strings(base):
    refused({**base, "architectures": "LlamaForCausalLM"}, r"architectures = 'LlamaForCausalLM' is not allowed")
    refused({**base, "hidden_act": 1}, r"hidden_act = 1 is not allowed \(allowed: a string\)")
    refused({**base, "torch_dtype": 16}, r"torch_dtype = 16 is not allowed \(allowed: a string\)")


def test_cli_prints_the_error_without_traceback(tmp_path):
    path = write_tiny_model(tmp_path / "m", tokenizer=False)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": 0}))
    proc = subprocess.run([sys.executable, "-m", "hwkv", "generate", "--model", str(path), "--prompt", "hi"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "ZeroDivisionError" not in proc.stderr
    assert f"{path / 'config.json'}: num_attention_heads = 0 is not allowed (allowed: an integer >= 1)" in proc.stderr


def test_non_finite_weights_warn_naming_the_tensor(tmp_path, cpu_backend):
    from safetensors.torch import load_file, save_file

    path = write_tiny_model(tmp_path / "m", tokenizer=False)
    w = load_file(path / "model.safetensors")
    w["model.layers.1.mlp.up_proj.weight"][3, :2] = float("nan")
    w["model.norm.weight"][0] = float("inf")
    save_file(w, path / "model.safetensors")
    with pytest.warns(RuntimeWarning) as rec:
        load_model(path, cpu_backend, load_tokenizer=False)
    msg = str(rec[0].message)
    assert "NaN or inf" in msg and "'model.layers.1.mlp.up_proj.weight' in model.safetensors (2 of 8192 values)" in msg
    assert "'model.norm.weight' in model.safetensors (1 of 64 values)" in msg


def test_finite_weights_load_without_warning(tmp_path, cpu_backend):
    import warnings

    from safetensors.torch import load_file, save_file

    path = write_tiny_model(tmp_path / "m", tokenizer=False, dtype=torch.float16)
    w = load_file(path / "model.safetensors")
    w["model.norm.weight"].fill_(60000.0)  # finite in float16, but its float16 sum overflows to inf
    save_file(w, path / "model.safetensors")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        load_model(path, cpu_backend, load_tokenizer=False)
