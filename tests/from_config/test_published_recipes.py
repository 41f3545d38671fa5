"""The published recipes by name (dflash=published, eagle3=published, peagle=published): each
composes over its trainer's small-machine defaults, passes the trainer's checks and builds a
head of the published shape on a small target architecture (no target weights, no training).
docs/training.md's "Default vs published" table lists the same settings."""

from omegaconf import OmegaConf

from selfspec.drafters import ParallelEagleDrafter
from selfspec.drafters.eagle_static import DynamicShape
from selfspec.from_config.common import CONF_DIR
from selfspec.from_config.methods.dflash import check_dflash_settings, dflash_config
from selfspec.from_config.methods.eagle import (
    check_eagle_settings,
    eagle_config,
    eagle_objective,
    eagle_trainer_drafter,
)
from selfspec.from_config.models import model_config
from selfspec.from_config.training import train_settings
from selfspec.heads import DFlashHead, EagleHead
from selfspec.model import Transformer

H = 32
# A small 8-layer target whose vocabulary holds the published draft vocabulary of 32,000.
ARCH = [f"model.arch.{k}={v}" for k, v in {
    "vocab_size": 32768, "hidden_size": H, "intermediate_size": 64, "num_heads": 4,
    "num_kv_heads": 2, "max_position_embeddings": 4096}.items()]


def composed(cfg_of, config: str, *overrides: str):
    """The config with its trainer's settings checked as every run checks them first."""
    cfg = cfg_of(config, *ARCH, "run_dir=/tmp/unused", *overrides)
    return cfg, train_settings(cfg)


def test_dflash_published_is_five_layers_one_stream_each_blocks_of_16(cfg_of):
    """(A setting given on the command line, here the clip, wins over the recipe's.)"""
    cfg, settings = composed(cfg_of, "train_dflash", "dflash=published", "optim.clip_grad=0.25")
    check_dflash_settings(cfg)
    head = DFlashHead(dflash_config(cfg, model_config(cfg.model), mask_token_id=5))
    c = head.config
    assert (c.num_layers, len(head.layers), c.block_size) == (5, 5, 16)
    assert len(set(c.target_layers)) == 5 and head.fc.weight.shape == (H, 5 * H)
    assert c.qk_norm and c.draft_vocab_size is None
    d = cfg.dflash
    assert (d.anchors, d.gamma, d.anchor_rule, d.loss) == (512, 7.0, "specforge", "ce")
    assert (settings.micro_batch_size, settings.lr, settings.clip_grad) == (1, 6e-4, 0.25)
    assert (cfg.trainer.seq_len, cfg.trainer.epochs) == (3072, 6)


def test_eagle3_published_is_the_papers_head_trees_and_training(cfg_of):
    cfg, settings = composed(cfg_of, "train_eagle", "eagle3=published")
    assert check_eagle_settings(cfg) == 3
    head = EagleHead(eagle_config(cfg, model_config(cfg.model)))
    c = head.config
    assert (c.version, c.parallel, c.target_layers) == (3, 1, (2, 4, 5))  # 2, L//2, L-3
    assert head.fc.weight.shape == (H, 3 * H) and head.fc.bias is None
    assert head.lm_head.weight.shape == (32000, H)
    drafter = eagle_trainer_drafter(cfg, head)
    assert drafter.shape == DynamicShape(total_tokens=60, depth=8, top_k=10)
    assert (cfg.eagle.ttt_steps, cfg.eagle.ttt_decay) == (7, 0.8)
    assert (settings.micro_batch_size, settings.lr, settings.clip_grad) == (1, 1e-4, 0.5)
    assert (cfg.trainer.seq_len, cfg.trainer.epochs) == (2048, 10)


def test_peagle_published_drafts_eight_tokens_a_forward(cfg_of):
    cfg, settings = composed(cfg_of, "train_eagle", "peagle=published")
    assert check_eagle_settings(cfg) == 3
    head = EagleHead(eagle_config(cfg, model_config(cfg.model), mask_token_id=5))
    assert (head.config.parallel, head.mask_hidden.shape) == (8, (H,))
    assert head.lm_head.weight.shape == (32000, H)
    drafter = eagle_trainer_drafter(cfg, head)
    assert isinstance(drafter, ParallelEagleDrafter) and drafter.k == 8
    assert drafter.shape.nodes is None  # a chain
    e = cfg.eagle
    assert (e.ttt_decay, e.parallel_loss, e.parallel_keep, e.parallel_keep_floor) == \
        (1.0, "pooled", 0.7, 0.2)
    objective = eagle_objective(cfg, Transformer(model_config(cfg.model)), head)
    assert (objective.pooled, objective.keep, objective.keep_floor) == (True, 0.7, 0.2)
    assert (settings.lr, settings.clip_grad, cfg.trainer.seq_len) == (6e-4, 0.5, 2048)


def test_the_defaults_stay_small():
    """The recipes replace their trainers' small-machine defaults, which stay as written."""
    dflash = OmegaConf.load(CONF_DIR / "train_dflash.yaml").dflash
    eagle = OmegaConf.load(CONF_DIR / "train_eagle.yaml").eagle
    assert (dflash.num_layers, dflash.block_size, dflash.anchors) < (5, 16, 512)
    assert (dflash.anchor_rule, eagle.version, eagle.parallel) == ("next", 1, 1)
    assert (eagle.parallel_loss, eagle.parallel_keep_floor) == ("per_copy", 0.0)
