"""The small-model entry (from_config/methods/small_model.py): PARD rows and their record."""

import pytest

from selfspec.from_config.methods import entry
from selfspec.from_config.methods.small_model import read_pard, write_pard


def test_pard_rows_come_as_chains_without_a_stop(cfg_of):
    cfg = cfg_of("sweep", "small_model.parallel=[false,true]", "small_model.first_candidates=[1,3]",
                 "small_model.confidence_threshold=[null,0.5]")
    labels = [v.label() for v in entry("small_model").variants(cfg, True)]
    assert labels == ["small_model", "small_model/pard", "small_model/stop0.5",
                      "small_model/top3", "small_model/top3/stop0.5"]
    with pytest.raises(ValueError, match="small_model.parallel: give true"):
        entry("small_model").variants(cfg_of("sweep", "small_model.parallel=[2]"), True)


def test_the_pard_record_is_read_back_or_named_missing(tmp_path):
    write_pard(tmp_path, 7, 4)
    assert read_pard(tmp_path) == {"mask_token_id": 7, "parallel": 4}
    with pytest.raises(FileNotFoundError, match=r"draft_model.parallel=K\): no pard.json"):
        read_pard(tmp_path / "nowhere")
