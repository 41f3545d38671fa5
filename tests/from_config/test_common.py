"""Shared config readers (from_config/common.py): every sampling config builds."""

import pytest
from helpers import group_options

from selfspec.from_config.common import sampling_params


@pytest.mark.parametrize("name", group_options("sampling"))
def test_every_sampling_config_builds(cfg_of, name):
    params = sampling_params(cfg_of("generate", f"sampling={name}").sampling)
    assert params.greedy == (name == "greedy")
    assert (params.top_p < 1) == (name == "top_p") and (params.top_k == 50) == (name == "top_k")
