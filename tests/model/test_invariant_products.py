"""The exact mode's products (`cpu_linear.use_invariant_products`, `batch_invariant=true`):
each row of a product the same bits whatever rows come with it, at any row count, on the
CPU's fp32 forms and in fixed-shape blocks elsewhere; and the settings that turn it on."""

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from selfspec.from_config.models import target_spec
from selfspec.model import loading
from selfspec.model.cpu_linear import (
    INVARIANT_BLOCK_ROWS,
    Linear,
    _fixed_shape_product,
    invariant_rows_of,
    use_invariant_products,
)

ROW_COUNTS = (1, 2, 3, 17, 64, 65, 129, 200)  # past one block and past the CPU's few rows


def rows_alone(product, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([product(x[i:i + 1]) for i in range(len(x))])


def moved_counts(product, x: torch.Tensor) -> list[int]:
    """The row counts at which some row of product(x[:n]) differs from that row alone."""
    alone = rows_alone(product, x)
    return [n for n in ROW_COUNTS if not torch.equal(product(x[:n]), alone[:n])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_a_linear_in_the_mode_gives_each_row_its_bits_alone(dtype):
    torch.manual_seed(0)
    layer = Linear(96, 80).to(dtype)
    use_invariant_products(layer, 16)
    x = torch.randn(max(ROW_COUNTS), 96, dtype=dtype)
    assert moved_counts(layer, x) == []
    exact = F.linear(x.double(), layer.weight.double(), layer.bias.double())
    tolerance = 1e-5 if dtype == torch.float32 else 0.05
    assert torch.allclose(layer(x).double(), exact, atol=tolerance)
    use_invariant_products(layer, None)
    assert layer.invariant_rows is None


@torch.no_grad()
def test_fixed_shape_blocks_hold_where_a_product_shaped_by_its_rows_does_not():
    torch.manual_seed(1)
    weight, x = torch.randn(80, 96), torch.randn(max(ROW_COUNTS), 96)
    assert moved_counts(lambda rows: _fixed_shape_product(rows, weight, 16), x) == []
    # the planted bug: the product in the rows' own shape (what the mode replaces)
    if not moved_counts(lambda rows: F.linear(rows, weight), x):
        pytest.skip("this CPU's products keep a row's bits at every count: nothing to catch")


def test_the_block_must_be_a_count():
    with pytest.raises(ValueError, match="block_rows must be an integer >= 1"):
        use_invariant_products(Linear(4, 4), 0)


def settings(**top) -> OmegaConf:
    model = {"name": "tiny-random", "random_weights": True, "dtype": "fp32",
             "arch": {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
                      "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}}
    return OmegaConf.create({"model": model, "device": "cpu", "seed": 0} | top)


def test_batch_invariant_true_loads_a_target_whose_products_are_invariant():
    spec = target_spec(settings(batch_invariant=True))
    assert spec.invariant_rows == INVARIANT_BLOCK_ROWS
    target, _ = loading.random_models(spec)
    assert invariant_rows_of(target) == INVARIANT_BLOCK_ROWS
    assert invariant_rows_of(loading.load(target_spec(settings()))) is None


@pytest.mark.parametrize("top, message", [
    ({"batch_invariant": "yes"}, "batch_invariant must be true or false"),
    ({"batch_invariant": True, "compile": True}, "set compile=false"),
])
def test_batch_invariant_refuses_what_it_cannot_make_invariant(top, message):
    with pytest.raises(ValueError, match=message):
        target_spec(settings(**top))
