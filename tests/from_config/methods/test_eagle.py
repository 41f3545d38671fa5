"""The EAGLE entry (from_config/methods/eagle.py): configs build heads, drafters, objectives."""

import pytest
import torch
from helpers import tiny_llama

from selfspec import from_config
from selfspec.drafters.eagle_static import DynamicShape
from selfspec.model import Transformer
from selfspec.training.loop import TokenRows


@pytest.mark.parametrize("version", [1, 2, 3])
def test_eagle_training_configs_build_their_heads_drafters_and_objectives(cfg_of, version):
    cfg = cfg_of("train_eagle", f"eagle.version={version}", "eagle.draft_vocab_size=32",
                 "eagle.target_layers=[0,1,2]", "eagle.ttt_steps=2", "run_dir=/tmp/unused")
    assert from_config.check_eagle_settings(cfg) == version
    target = Transformer.from_hf(tiny_llama(0))
    head, config = from_config.eagle_head(cfg, target)
    assert config.version == (3 if version == 3 else 1) and head.config == config
    tokens = torch.randint(2, 64, (6, 12), generator=torch.Generator().manual_seed(0))
    rows = TokenRows(tokens, torch.ones_like(tokens))
    from_config.eagle_draft_vocab(head, target, rows)
    drafter = from_config.eagle_drafter(cfg, head)
    if version == 1:  # the static chain4 tree
        assert drafter.shape.tree.is_chain and drafter.max_nodes == 4
    else:  # the EAGLE-2 defaults for a CPU
        assert drafter.shape == DynamicShape(total_tokens=8, depth=3, top_k=2)
    objective = from_config.eagle_objective(cfg, target, head)
    assert objective(rows.tokens, rows.loss_mask).loss.isfinite()
    if version == 3:
        seen = tokens.unique()
        assert len(seen) > 32  # so the draft vocabulary holds training tokens only
        assert set(head.draft_vocab.target_ids.tolist()) < set(seen.tolist())
