"""HF checkpoints, tokenizers and math data: parity with transformers' Qwen3, save -> transformers
load round trips, config and data errors, the DAPO grader, and init-model + a run from its output."""
import json

import pytest
import torch
from omegaconf import OmegaConf

from lockstep.framework import settings
from lockstep.framework.data.dataset import DataError, load_records
from lockstep.framework.data.rewards import dapo_reward
from lockstep.framework.data.tokenizer import HFTokenizer, train_tokenizer, tokenizer_for
from lockstep.framework.models.hf import CheckpointError, CheckpointReader
from lockstep.framework.models.ops import ALL_P, ALL_R, build_ops
from lockstep.framework.models.qwen3 import Qwen3Config, Qwen3ForCausalLM

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-6)
CORPUS = ["What is 12 times 13? The answer is \\boxed{156}.", "Solve 3x + 7 = 22 for x: x = 5.", "0123456789 +-*/=()"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A random transformers Qwen3 (untied head), saved sharded, with a tokenizer trained here."""
    path = tmp_path_factory.mktemp("hf-qwen3")
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SHAPE, tie_word_embeddings=False))
    model.save_pretrained(path, max_shard_size="60KB")
    train_tokenizer(CORPUS, path, vocab_size=300)
    return path


def test_the_checkpoint_is_sharded_with_an_index(hf_dir):
    assert (hf_dir / "model.safetensors.index.json").exists() and len(list(hf_dir.glob("model-*.safetensors"))) > 2
    reader = CheckpointReader(hf_dir)
    assert "lm_head.weight" in reader.names  # untied
    assert set(reader.tensors(["model.norm.weight"])) == {"model.norm.weight"}


@pytest.mark.parametrize("selection", [ALL_P, ALL_R], ids=["stock-ops", "lockstep-kernels"])
def test_logits_match_transformers(hf_dir, selection):
    ours = Qwen3ForCausalLM.from_pretrained(hf_dir, build_ops(selection)).eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert ours.config.tie_word_embeddings is False and ours.config.rope_theta == 10000.0
    ids = torch.randint(0, SHAPE["vocab_size"], (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = ours(ids, torch.arange(17).expand(3, 17))
        logits = ours.logits(hidden)
        ref = theirs(input_ids=ids).logits.float()
    # float32, different implementations (and summation orders): close, not bitwise
    assert torch.allclose(logits, ref, atol=2e-5, rtol=1e-4), float((logits - ref).abs().max())


def test_save_round_trips_through_transformers_bitwise(hf_dir, tmp_path):
    ours = Qwen3ForCausalLM.from_pretrained(hf_dir, build_ops(ALL_R))
    ours.save_pretrained(tmp_path, max_shard_bytes=100_000)
    HFTokenizer(hf_dir).save(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").exists()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    theirs = back.state_dict()
    for name, t in ours.hf_state_dict().items():
        assert torch.equal(theirs[name], t), name
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert tok("x = 5")["input_ids"] == HFTokenizer(hf_dir).tok("x = 5")["input_ids"]


def test_the_chat_template_and_eos_come_from_the_checkpoint(hf_dir):
    tok = tokenizer_for([], str(hf_dir))
    assert isinstance(tok, HFTokenizer)
    ids = tok.encode_prompt([{"role": "user", "content": "What is 12 times 13?"}])
    text = tok.tok.decode(ids)
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
    assert tok.eos_ids == [tok.tok.convert_tokens_to_ids("<|im_end|>"), tok.tok.convert_tokens_to_ids("<|endoftext|>")]
    assert tok.vocab_size < SHAPE["vocab_size"]  # the padded ids beyond the tokenizer's are masked


def _cfg(init_from, **model):
    base = OmegaConf.load(settings.__file__.replace("framework/settings.py", "configs/model/qwen3-tiny.yaml"))
    return OmegaConf.create({"model": {**OmegaConf.to_container(base), "init_from": str(init_from), **model}})


def test_shapes_come_from_config_json_and_an_explicit_conflict_names_both(hf_dir):
    shape = settings.model_config(_cfg(hf_dir), tokenizer_vocab=300)  # the group's hidden_size=64 default is not asked for
    assert shape["intermediate_size"] == 96 and shape["vocab_size"] == 320
    with pytest.raises(settings.ConfigError, match=r"model.intermediate_size=128 \(command line\) vs "
                                                   r"intermediate_size=96 in .*config.json"):
        settings.model_config(_cfg(hf_dir, intermediate_size=128), 300, overrides=["model.intermediate_size=128"])


@pytest.mark.parametrize("key,value", [("rope_scaling", {"rope_type": "yarn", "factor": 4.0}),
                                       ("attention_bias", True), ("use_sliding_window", True)])
def test_unsupported_config_features_are_errors_naming_the_key(key, value):
    d = {"model_type": "qwen3", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
         "num_attention_heads": 2, key: value}
    with pytest.raises(CheckpointError, match=f"does not implement {key}"):
        Qwen3Config.from_hf(d)


def test_a_checkpoint_without_weights_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(CheckpointError, match="holds neither model.safetensors nor model.safetensors.index.json"):
        CheckpointReader(tmp_path)


# ---- data -----------------------------------------------------------------------------------------

def test_the_math_sample_loads_in_the_dapo_layout():
    data = load_records("builtin:math_sample", label_key="auto")
    assert len(data.records) == 40 and not data.skipped
    r = data.records[1]
    assert r.messages()[0]["role"] == "user" and "\\boxed{}" in r.messages()[0]["content"]
    assert r.label == "\\frac{7}{8}"


def test_bad_rows_are_errors_with_file_and_line(tmp_path):
    good = json.dumps({"prompt": [{"role": "user", "content": "1+1?"}], "reward_model": {"ground_truth": "2"}})
    f = tmp_path / "d.jsonl"
    f.write_bytes(good.encode() + b"\n" + b'{"prompt": "caf\xe9", "label": "x"}\n' + b"[1, 2]\n"
                  + json.dumps({"prompt": "2+2?"}).encode() + b"\n")
    with pytest.raises(DataError, match=f"{f}:2: not UTF-8"):
        load_records(str(f), label_key="auto")
    data = load_records(str(f), label_key="auto", skip_bad_rows=True)
    assert len(data.records) == 1 and len(data.skipped) == 3
    assert data.skipped[1].startswith(f"{f}:3: a row must be a JSON object")
    assert "no answer at 'reward_model.ground_truth' or 'label'" in data.skipped[2]


@pytest.mark.parametrize("response,label,want", [
    ("so \\boxed{\\frac{7}{8}}", "\\frac{7}{8}", 1.0),
    ("\\boxed{\\frac78}", "\\frac{7}{8}", 1.0),  # DAPO's normaliser adds the braces
    ("first \\boxed{3} then, correcting, \\boxed{5}", "5", 1.0),  # the last box counts
    ("first \\boxed{5} then \\boxed{3}", "5", 0.0),
    ("\\boxed{\\frac{a}{b^{2}}}", "\\frac{a}{b^{2}}", 1.0),  # nested braces
    ("\\boxed{5 \\text{ cm}}", "5", 1.0),  # units dropped
    ("\\boxed{720^\\circ}", "720", 1.0),
    ("\\boxed{x = 12}", "12", 1.0),  # the part after the last =
    ("\\boxed{1,000}", "1000", 1.0),
    ("the answer is 156", "156", 0.0),  # no box, no credit
    ("\\boxed{2\\sqrt3}", "2\\sqrt{3}", 1.0),
    ("\\boxed{-\\frac{1}{6}}", "\\frac{1}{6}", 0.0),
])
def test_dapo_grader(response, label, want):
    assert dapo_reward("", response, label) == want


@pytest.mark.slow
def test_init_model_then_run_from_it(ray_session, tmp_path, capsys):
    from lockstep.framework.tracking.jsonl import read_jsonl
    from lockstep.launch import cli

    ckpt = tmp_path / "model"
    assert cli.main(["init-model", "--like", "qwen3-0.6b", "--out", str(ckpt), "num_hidden_layers=2",
                     "hidden_size=128", "intermediate_size=256", "num_attention_heads=4", "num_key_value_heads=2",
                     "head_dim=32", "vocab_size=1024", "--max-shard-mb", "0.3"]) == 0
    assert (ckpt / "model.safetensors.index.json").exists()
    run = tmp_path / "run"
    assert cli.main(["run", "qwen3-0.6b", f"model.init_from={ckpt}", "trainer.steps=5", f"hydra.run.dir={run}",
                     "logger.progress=false", "logger.wandb.enabled=false"]) == 0
    rows = read_jsonl(run / "metrics.jsonl")
    assert len(rows) == 5 and all(r["consistency/mismatch_count"] == 0 and r["consistency/numel"] > 0 for r in rows)
    back = transformers.AutoModelForCausalLM.from_pretrained(run / "checkpoint")  # the run's final checkpoint
    assert back.config.num_hidden_layers == 2
    capsys.readouterr()
    assert cli.main(["run", "qwen3-0.6b", f"hydra.run.dir={tmp_path / 'none'}"]) == 1
    assert "this recipe starts from a checkpoint: set model.init_from=DIR" in capsys.readouterr().err
