"""The mixture of experts (model/moe.py): both dispatches equal a token-by-token reading of
the block, the static one reads nothing back to the host, and a static decode step uses it."""

import dataclasses

import pytest
import torch
from helpers import family_config, host_reads_per_step, tiny_model

from selfspec import generate
from selfspec.devices import HostReads
from selfspec.model import ModelConfig, Transformer
from selfspec.model.moe import MoE

MOE = ("qwen3_moe", "mixtral", "gpt_oss")


def reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """[N, hidden] the block token by token, expert by expert: its plainest reading."""
    routing = moe.route(x)
    rows = []
    for n in range(x.shape[0]):
        row = torch.zeros_like(x[n])
        for e, w in zip(routing.experts[n].tolist(), routing.weights[n], strict=True):
            row = row + w * moe.experts.one(e, x[n:n + 1])[0]
        rows.append(row)
    return torch.stack(rows)


def random_moe(family: str, seed: int = 0, **overrides) -> MoE:
    config = dataclasses.replace(ModelConfig.from_hf(family_config(family).to_dict()),
                                 **overrides)
    torch.manual_seed(seed)
    moe = MoE(config)
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0.0, 0.3)
    return moe


@pytest.mark.parametrize("family", MOE)
@pytest.mark.parametrize("tokens", [1, 3, 16])  # 3 x top 2 < 8 experts: gathered; 16: every
@torch.no_grad()
def test_both_dispatches_equal_the_block_read_token_by_token(family, tokens):
    moe = random_moe(family, norm_topk_prob=family != "qwen3_moe")
    x = torch.randn(1, tokens, moe.gate.in_features, generator=torch.Generator().manual_seed(2))
    expected = reference(moe, x[0])
    assert expected.abs().max() > 0.5
    for static in (False, True):
        torch.testing.assert_close(moe(x, static=static)[0], expected, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_routing_weights_are_renormalised_only_with_norm_topk_prob():
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(3))
    renormalised = random_moe("qwen3_moe", norm_topk_prob=True).route(x).weights
    share = random_moe("qwen3_moe", norm_topk_prob=False).route(x).weights
    torch.testing.assert_close(renormalised.sum(-1), torch.ones(5))
    assert (share.sum(-1) < 0.999).all()
    torch.testing.assert_close(share / share.sum(-1, keepdim=True), renormalised)


@torch.no_grad()
def test_the_static_dispatch_reads_nothing_back_to_the_host():
    moe = random_moe("gpt_oss")
    for tokens in (2, 16):
        x = torch.randn(1, tokens, 32)
        with HostReads() as reads:
            moe(x, static=True)
        assert reads.count == 0
    with HostReads() as reads:
        moe(x)
    assert reads.count > 0  # the eager one reads its groups' sizes: the counter sees it


@pytest.mark.parametrize("family", MOE)
def test_static_steps_decode_a_moe_target_as_eager_forwards_do(family):
    """Plain greedy decoding in static steps (its MoE layers on the static dispatch) gives
    the eager decoding's tokens, with one host read a step."""
    target = Transformer.from_hf(tiny_model(family, 0)).eval()
    prompt = [5, 9, 2, 7, 7, 3, 11, 4]
    eager = generate(target, prompt, max_new_tokens=16).tokens
    assert generate(target, prompt, max_new_tokens=16, cuda_graphs=True).tokens == eager
    assert host_reads_per_step(target, lambda: None, prompt) == 1


@torch.no_grad()
def test_qwen3_moe_without_renormalising_and_with_sparse_steps_gives_transformers_logits():
    """norm_topk_prob off, every second layer sparse and one of those dense again."""
    from helpers import assert_hf_parity

    hf = tiny_model("qwen3_moe", 0, layers=6, norm_topk_prob=False, decoder_sparse_step=2,
                    mlp_only_layers=[3])
    ours = Transformer.from_hf(hf).eval()
    assert ours.config.moe_layers == {1, 5} and not ours.config.norm_topk_prob
    assert_hf_parity(ours, hf, seq_len=12)
