import torch

from selfspec.demo import P, Q, first_token_law, main


def test_demo_shows_the_target_law_not_the_draft_law(capsys):
    for siblings in (1, 3):
        law, tokens_per_step = first_token_law(draws=3000, seed=1, siblings=siblings)
        assert (law - P).abs().max() < 0.035 < (law - Q).abs().max()
        assert tokens_per_step > 1
    main(["--draws", "200"])
    assert "target p" in capsys.readouterr().out
    assert torch.isclose(P.sum(), torch.tensor(1.0))
