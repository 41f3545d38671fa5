"""Shared config readers (from_config/common.py): every sampling config builds."""

import pytest
from helpers import group_options

from selfspec import from_config


@pytest.mark.parametrize("name", group_options("sampling"))
def test_every_sampling_config_builds(cfg_of, name):
    params = from_config.sampling_params(cfg_of("generate", f"sampling={name}").sampling)
    assert params.greedy == (name == "greedy")
    assert (params.top_p < 1) == (name == "top_p") and (params.top_k == 50) == (name == "top_k")
