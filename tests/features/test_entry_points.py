"""Every entry point refuses bad input with one line `error: ...` and exit status 2 (no
traceback), and a resumed training run refuses a config that would change what it trains."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState
from helpers import run_script, sharegpt_file

from selfspec.cli import USAGE_ERROR

ROOT = Path(__file__).resolve().parents[2]
TRAIN, GENERATE, SWEEP, LOSSLESS = ("train/medusa.py", "eval/generate.py", "eval/sweep.py",
                                    "eval/lossless.py")
EAGLE = "train/eagle.py"
EARLY_EXIT = "train/early_exit.py"
STORE = "train/store.py"
HELDOUT = "scripts/heldout_loss.py"
EXPORT = "scripts/export_heads.py"
NO_SUCH_GPU = "device=cuda:99"
NO_SUCH_GPU_SAYS = r"CUDA is not available|CUDA device\(s\)"  # a CPU machine | a GPU machine

# (entry point, arguments, a regular expression the one error line must match). {toy} is a
# working model folder, the other {names} broken copies of it (see `files`).
BAD_INPUTS = [
    (TRAIN, ["medusa.version=3"], r"medusa.version must be 1 \(frozen target\) or 2"),
    (TRAIN, ["optim.lr=-1"], r"optim.lr must be > 0, got -1.0"),
    (TRAIN, ["trainer.max_steps=0"], r"trainer.max_steps must be >= 1, got 0"),
    (TRAIN, ["trainer.micro_batch_size=0"], r"trainer.micro_batch_size must be >= 1"),
    (TRAIN, ["optim.warmup_steps=-5"], r"optim.warmup_steps must be >= 0"),
    (TRAIN, ["medusa.version=2", "medusa.lora.rank=0"], r"rank must be an integer >= 1"),
    (TRAIN, ["medusa.num_heads=0"], r"medusa.num_heads must be an integer >= 1, got 0"),
    (TRAIN, ["medusa.decay=-1"], r"medusa.decay must be > 0"),
    (TRAIN, ["trainer.seq_len=0"], r"trainer.seq_len must be an integer >= 2, got 0"),
    (TRAIN, ["trainer.threads=-1"], r"trainer.threads must be an integer >= 1, got -1"),
    (TRAIN, ["seed=-1"], r"seed must lie in \[0, 2\*\*32\), got -1"),
    (TRAIN, [NO_SUCH_GPU], NO_SUCH_GPU_SAYS),
    (TRAIN, ["device=banana"], r"device=banana: not a device name; use cpu, cuda"),
    (TRAIN, ["model=local", "model.path={no_heads}"],
     r"no_heads/config.json: config.json lacks num_attention_heads"),
    (TRAIN, ["model=local", "model.path={cut_short}"],
     r"cut_short/model.safetensors is not a complete safetensors file .* copy it again"),
    (TRAIN, ["model=local", "model.path={no_tokenizer}"], r"no tokenizer in model folder"),
    (TRAIN, ["model=local", "model.path={toy}", "train_data.source=sharegpt",
             "train_data.path={not_json}"], r"ShareGPT file .*chat.json is not JSON"),
    (TRAIN, ["model=local", "model.path={toy}", "train_data.source=sharegpt"],
     r"train_data.source=sharegpt needs train_data.path"),
    (TRAIN, ["model=local", "model.path={toy}", "train_data.source=web"],
     r"unknown train_data.source 'web'"),
    (TRAIN, ["model=local", "model.path={toy}", "medusa.num_heads=2", "tree=medusa_63"],
     r"only 2 Medusa heads"),
    (TRAIN, ["trainer.speed=11"], r"Could not override 'trainer.speed'"),
    (EAGLE, ["eagle.version=4"], r"eagle.version must be 1, 2 or 3"),
    (EAGLE, ["eagle.version=2", "eagle.total_tokens=3", "eagle.depth=5"],
     r"total_tokens \(3\) < depth \(5\)"),
    (EAGLE, ["eagle.version=2", "eagle.top_k=5000"], r"top_k \(5000\) exceeds the 4096 tokens"),
    (EAGLE, ["eagle.version=3", "eagle.draft_vocab_size=5000"],
     r"eagle.draft_vocab_size 5000 exceeds the target's vocab_size 4096"),
    (EAGLE, ["eagle.version=3", "eagle.target_layers=[2,4]"], r"fuses three target layers"),
    (EAGLE, ["tree=top_k_products"], r"eagle.version=1 drafts a static tree"),
    (EAGLE, ["eagle.feature_noise=-1"], r"eagle.feature_noise must be >= 0"),
    (EAGLE, ["eagle.version=3", "eagle.ttt_steps=0"], r"eagle.ttt_steps must be an integer >= 1"),
    (EARLY_EXIT, ["early_exit.exit_layers=[0]"],
     r"exit layer E must be an integer in \[1, 8\) .*got 0 for this 8-layer target"),
    (EARLY_EXIT, ["early_exit.exit_layers=[2,8]"], r"E must be an integer in \[1, 8\).* got 8"),
    (EARLY_EXIT, ["early_exit.confidence_threshold=1.5"],
     r"confidence_threshold must lie in \(0, 1\)"),
    (EARLY_EXIT, ["early_exit.num_draft_tokens=0"],
     r"early_exit.num_draft_tokens must be an integer >= 1"),
    (EARLY_EXIT, ["early_exit.hard_weight=-1"], r"early_exit.hard_weight must be >= 0"),
    (STORE, ["store.dtype=fp16"], r"store.dtype must be one of fp32, bf16, fp8, got 'fp16'"),
    (STORE, ["store.out=null"], r"store.out: give the folder to write the feature store into"),
    (STORE, ["store.rows_per_shard=0"], r"store.rows_per_shard must be an integer >= 1"),
    (STORE, ["store.layers=[9]"], r"store.layers: each entry is a layer count in \[0, 8\], "
                                  r"dflash or eagle3, got 9"),
    (STORE, ["model=local", "model.path={toy}", "store.layers=[]", "train_data.source=jsonl"],
     r"train_data.source=jsonl needs train_data.path"),
    (TRAIN, ["model=local", "model.path={toy}", "train_data.source=sharegpt",
             "train_data.path={chat}", "trainer.seq_len=32", "trainer.features={out}"],
     r"export_out holds no finished feature store \(no index.json\)"),
    (TRAIN, ["model=local", "model.path={toy}", "train_data.source=sharegpt",
             "train_data.path={chat}", "trainer.seq_len=32", "train_data.max_answers=0"],
     r"train_data.max_answers must be an integer >= 1, got 0"),
    (TRAIN, ["model=gpt5"], r"Could not find 'model/gpt5'"),
    (TRAIN, ["model=local"], r"model.path: not set"),
    (TRAIN, ["model=llama2-70b"], r"meta-llama/Llama-2-70b-hf.* is not available on this"),
    (GENERATE, ["max_new_tokens=-3"], r"max_new_tokens must be an integer >= 1, got -3"),
    (GENERATE, ["sampling.temperature=-1"], r"sampling.temperature must be a finite number"),
    (GENERATE, ["sampling.top_p=1.5"], r"sampling.top_p must lie in \(0, 1\]"),
    (GENERATE, ["sampling.top_k=-2"], r"sampling.top_k must be an integer >= 0"),
    (GENERATE, ["drafter=eagle9"], r"unknown drafter 'eagle9'"),
    (GENERATE, ["num_draft_tokens=0"], r"num_draft_tokens must be an integer >= 1"),
    (GENERATE, ["confidence_threshold=1"], r"confidence_threshold must lie in \(0, 1\)"),
    (GENERATE, ["first_candidates=0"], r"first_candidates must be an integer >= 1, got 0"),
    (GENERATE, [NO_SUCH_GPU], NO_SUCH_GPU_SAYS),
    (GENERATE, ["data=mt_bench", "data.path=/nonexistent/q.jsonl"],
     r"mt_bench question file not found: /nonexistent/q.jsonl"),
    (GENERATE, ["model=local", "model.path=/nonexistent"], r"model.path=/nonexistent: no "),
    (SWEEP, ["methods=[small_model,layerskip]"], r"unknown method\(s\) \['layerskip'\]"),
    (SWEEP, ["num_draft_tokens=[2,0]"], r"num_draft_tokens must be integers >= 1"),
    (SWEEP, ["samplings=[greedy,hot]"], r"unknown sampling setting 'hot'"),
    (SWEEP, ["bench.repeats=0"], r"bench.repeats must be an integer >= 1"),
    (SWEEP, [NO_SUCH_GPU], NO_SUCH_GPU_SAYS),
    (SWEEP, ["threads=0"], r"threads must be an integer >= 1, got 0"),
    (SWEEP, ["model.draft.path=/nonexistent"], r"model.draft.path=/nonexistent: no config"),
    (SWEEP, ["methods=[medusa]", "medusa_heads=/nonexistent/export"], r"no head_config.json"),
    (SWEEP, ["methods=[early_exit]", "early_exit.exit_layers=[9]"],
     r"exit layer E must be an integer in \[1, 8\)"),
    (SWEEP, ["methods=[early_exit]", "early_exit.confidence_threshold=[0.6,0]"],
     r"confidence_threshold must lie in \(0, 1\)"),
    (SWEEP, ["methods=[early_exit]", "early_exit.exits=/nonexistent/export"],
     r"early_exit.exits=/nonexistent/export/E2: no head_config.json"),
    (SWEEP, ["methods=[early_exit]", "early_exit.exits={exits_other_target}",
             "early_exit.exit_layers=[2]"], r"E2 was trained for another target .*hidden_size 32"),
    (SWEEP, ["methods=[early_exit]", "early_exit.exits={exits_other_e}",
             "early_exit.exit_layers=[3]"], r"exits at layer E=2, not E=3"),
    (LOSSLESS, ["methods=[early_exit]", "early_exit.exit_layers=[0]"],
     r"exit layer E must be an integer in \[1, 8\)"),
    (LOSSLESS, ["methods=[warp]"], r"unknown method\(s\) \['warp'\]"),
    (LOSSLESS, ["num_prompts=0"], r"the number of prompts must be >= 1"),
    (LOSSLESS, ["max_new_tokens=0"], r"max_new_tokens must be an integer >= 1, got 0"),
    (LOSSLESS, ["device=banana"], r"device=banana: not a device name"),
    (HELDOUT, ["/nonexistent/model"], r"/nonexistent/model has no config.json"),
    (EXPORT, ["/nonexistent/head", "--to", "vllm", "{out}"],
     r"head checkpoint folder not found: /nonexistent/head"),
    (EXPORT, ["{eagle_biased}", "--to", "medusa", "{out}"],
     r"an EAGLE head is not a Medusa head: export with --to vllm, sglang or eagle"),
    (EXPORT, ["{medusa_heads}", "--to", "sglang", "{out}"],
     r"SGLang serves EAGLE and DFlash heads, not Medusa heads: export with --to vllm"),
    (EXPORT, ["{medusa_shared}", "--to", "vllm", "{out}"],
     r"share the target's LM head, which the export writes: pass --target"),
]


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    yield
    AcceleratorState._reset_state(True)  # an in-process training run leaves its Accelerator


@pytest.fixture(scope="module")
def files(tmp_path_factory, quick_build) -> dict[str, str]:
    """A working toy model folder and broken copies of it, each broken one way."""
    root, toy = tmp_path_factory.mktemp("inputs"), quick_build / "target"

    def copy(name: str) -> Path:
        return Path(shutil.copytree(toy, root / name))

    config = copy("no_heads") / "config.json"
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items()
                                  if k != "num_attention_heads"}))
    weights = copy("cut_short") / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    no_tokenizer = copy("no_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (no_tokenizer / name).unlink(missing_ok=True)
    (root / "chat.json").write_text("def not_json(): pass\n")
    (root / "chat").mkdir()
    return {"toy": str(toy), "no_heads": str(config.parent), "cut_short": str(weights.parent),
            "no_tokenizer": str(no_tokenizer), "not_json": str(root / "chat.json"),
            "chat": str(sharegpt_file(root / "chat")),
            "out": str(root / "export_out"), **exit_exports(root), **head_exports(root)}


def exit_exports(root: Path) -> dict[str, str]:
    """Early-exit exports the tiny target must refuse: one trained for a 32-wide target, one
    whose E3 folder holds an exit at layer 2."""
    from selfspec.heads import ExitConfig, ExitHead, save_head
    from selfspec.model import ModelConfig

    tiny = ModelConfig(vocab_size=4096, hidden_size=256, intermediate_size=688, num_layers=8,
                       num_heads=8, num_kv_heads=4, head_dim=32)
    narrow = ModelConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_layers=8,
                         num_heads=4, num_kv_heads=2, head_dim=8)
    for name, config, folder in (("exits_other_target", narrow, "E2"),
                                 ("exits_other_e", tiny, "E3")):
        head = ExitHead(ExitConfig.for_target(config, 2, "norm"))
        info = {"hidden_size": config.hidden_size, "vocab_size": 4096, "num_layers": 8}
        save_head(root / name / folder, head, head.config, info)
    return {name: str(root / name) for name in ("exits_other_target", "exits_other_e")}


def head_exports(root: Path) -> dict[str, str]:
    """Heads an engine export must refuse: an EAGLE-1 head (for Medusa's code), Medusa heads
    (for SGLang), heads sharing an LM head with no target recorded."""
    from selfspec.heads import EagleConfig, EagleHead, MedusaConfig, MedusaHeads, save_head
    from selfspec.model import ModelConfig

    narrow = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4,
                         num_heads=4, num_kv_heads=2, head_dim=8)
    eagle = EagleHead(EagleConfig.for_target(narrow, 1))
    torch.nn.init.normal_(eagle.fc.bias)
    info = {"hidden_size": 32, "vocab_size": 64, "num_layers": 4}
    heads = {"eagle_biased": eagle,
             "medusa_heads": MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=64)),
             "medusa_shared": MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=64,
                                                       shared_lm_head=True))}
    for name, head in heads.items():
        save_head(root / name, head, head.config, info)
    return {name: str(root / name) for name in heads}


def run_entry(script: str, args: list[str], run_dir: Path, monkeypatch, capsys) -> tuple:
    """Run an entry point in this process as `python script args...` would; returns (exit
    status, stdout, stderr). Hydra entry points write into run_dir."""
    if script in (TRAIN, EAGLE, EARLY_EXIT, SWEEP):
        args = [*args, "wandb.enabled=false"]
    if not script.startswith("scripts/"):
        args = [*args, f"hydra.run.dir={run_dir}"]
    return run_script(script, args, monkeypatch, capsys)


@pytest.mark.parametrize("script, args, says", BAD_INPUTS,
                         ids=[f"{s.split('/')[-1]}:{' '.join(a)}" for s, a, _ in BAD_INPUTS])
def test_bad_input_is_refused_in_one_line(script, args, says, files, tmp_path, monkeypatch,
                                          capsys):
    args = [a.format(**files) for a in args]
    code, _, err = run_entry(script, args, tmp_path / "run", monkeypatch, capsys)
    lines = err.strip().splitlines()
    assert code == USAGE_ERROR, err[-2000:]
    assert "Traceback" not in err
    assert lines[-1].startswith("error: ") and sum(x.startswith("error:") for x in lines) == 1
    assert re.search(says, lines[-1]), lines[-1]



# ---- resuming a run folder --------------------------------------------------------------------


def toy_training(files: dict, run_dir: Path, *extra: str) -> list[str]:
    chat = run_dir.parent / "chat.json"
    if not chat.exists():
        chat.write_text(json.dumps([{"conversations": [
            {"from": "human", "value": f"Add {i}."},
            {"from": "gpt", "value": f"def add_{i}(x):\n    return x + {i}\n"}]}
            for i in range(40)]))
    return ["model=local", f"model.path={files['toy']}", "train_data.source=sharegpt",
            f"train_data.path={chat}", "trainer.max_steps=4", "trainer.micro_batch_size=2",
            "trainer.seq_len=32", "trainer.save_every=2", "final_eval.num_prompts=0",
            "medusa.num_heads=2", *extra]


def test_a_resume_with_a_config_that_shapes_the_weights_differently_is_refused(
    files, tmp_path, monkeypatch, capsys
):
    run_dir = tmp_path / "run"
    first = run_entry(TRAIN, toy_training(files, run_dir, "trainer.stop_after=2"), run_dir,
                      monkeypatch, capsys)
    assert first[0] == 0, first[2][-2000:]
    assert (run_dir / "checkpoints/step_0000002/COMPLETE").is_file()
    changed = toy_training(files, run_dir, "trainer.resume=true", "medusa.num_heads=3",
                           "optim.lr=0.01")
    code, _, err = run_entry(TRAIN, changed, run_dir, monkeypatch, capsys)
    assert code == USAGE_ERROR and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert "medusa.num_heads: 2 in the run, 3 now" in line
    assert "optim.lr: 0.001 in the run, 0.01 now" in line
    # settings that shape neither the weights nor the optimizer may change
    allowed = toy_training(files, run_dir, "trainer.resume=true", "trainer.log_every=1",
                           "trainer.eval_every=2", "final_eval.max_new_tokens=4")
    code, _, err = run_entry(TRAIN, allowed, run_dir, monkeypatch, capsys)
    assert code == 0, err[-2000:]
    assert (run_dir / "checkpoints/step_0000004/COMPLETE").is_file()
