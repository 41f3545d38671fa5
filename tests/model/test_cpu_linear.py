"""The CPU's few-row products (model/cpu_linear.py): nn.Linear's sums, a packed weight copy."""

import copy

import pytest
import torch

from selfspec.model import Linear, use_packed_products


@pytest.mark.parametrize("shape", [(1, 1, 48), (1, 2, 48), (1, 3, 48), (3, 5, 48), (1, 8, 48),
                                   (2, 64, 48), (2, 100, 48)])
@pytest.mark.parametrize("grad", [False, True])
def test_cpu_linear_computes_what_nn_linear_does(shape, grad):
    """selfspec's Linear runs few-row CPU products its own way (one row twice, W @ x.T, from
    three rows oneDNN over a packed copy of W when no gradient is needed): the same sums as
    nn.Linear, up to float32 rounding, in the input's shape, bias included, row-major as
    F.linear's (SDPA's fused CPU kernel refuses queries whose last dimension is strided)."""
    torch.manual_seed(0)
    layer = Linear(48, 200, bias=True)
    use_packed_products(layer, True)
    x = torch.randn(*shape)
    with torch.set_grad_enabled(grad):
        out = layer(x)
    assert out.shape == (*shape[:-1], 200) and out.requires_grad == grad
    assert out.is_contiguous()
    torch.testing.assert_close(out, torch.nn.functional.linear(x, layer.weight, layer.bias),
                               rtol=1e-5, atol=1e-5)


def test_the_packed_copy_follows_the_weight_and_is_never_copied():
    torch.manual_seed(0)
    layer = Linear(48, 200, bias=False)
    use_packed_products(layer, True)
    x = torch.randn(4, 48)
    with torch.no_grad():
        before = layer(x)
        assert layer.packed.tensor is not None  # four rows took the packed path
        layer.weight.mul_(2.0)  # changed in place (an optimizer step, load_state_dict)
        torch.testing.assert_close(layer(x), 2 * before, rtol=1e-5, atol=1e-5)
        layer.weight = torch.nn.Parameter(-layer.weight)  # replaced
        torch.testing.assert_close(layer(x), -2 * before, rtol=1e-5, atol=1e-5)
        twin = copy.deepcopy(layer)
        assert twin.packed.tensor is None and "packed" not in "".join(twin.state_dict())
        torch.testing.assert_close(twin(x), -2 * before, rtol=1e-5, atol=1e-5)


def test_few_rows_keep_their_bits_among_others_and_a_streamed_weight_takes_its_faster_form():
    """Without `fastest` a row's product is the same bits alone and among others (the form
    `invariant_form` found on this CPU); with it (a streamed model's layers) one or two rows
    take the form timed faster for the weight's shape, kept for later products, equal to
    F.linear's up to rounding."""
    from selfspec.model import cpu_linear

    torch.manual_seed(0)
    weight, x = torch.randn(3000, 512), torch.randn(8, 512)
    with torch.no_grad():
        alone = cpu_linear.linear(x[:1], weight)
        for rows in (2, 3, 8):
            assert torch.equal(cpu_linear.linear(x[:rows], weight)[:1], alone)
        for rows in (1, 2):
            fast = cpu_linear.linear(x[:rows], weight, fastest=True)
            torch.testing.assert_close(fast, torch.nn.functional.linear(x[:rows], weight),
                                       rtol=1e-5, atol=1e-4)
    for rows in (1, 2):
        form = cpu_linear.few_row_form(weight, rows)
        assert form in cpu_linear.FEW_ROW_FORMS
        assert cpu_linear._CHOSEN[(tuple(weight.shape), torch.get_num_threads(), rows)] == form


@pytest.mark.parametrize("seconds, chosen", [
    ({"transposed": 3.0, "mkl": 1.0, "packed": 1.05}, "packed"),  # the invariant one, in a tie
    ({"transposed": 3.0, "mkl": 1.0, "packed": 1.5}, "mkl"),  # else the fastest
    ({"transposed": 1.0, "mkl": 2.0}, "transposed"),  # no oneDNN
])
def test_one_or_two_rows_take_the_fastest_form_or_the_invariant_one_within_a_tie(
        monkeypatch, seconds, chosen):
    """A streamed weight's one- or two-row product takes the form timed fastest, unless the
    form whose rows keep their bits among others runs within FEW_ROW_TIE of it."""
    from selfspec.model import cpu_linear

    monkeypatch.setattr(cpu_linear, "_CHOSEN", {})
    monkeypatch.setattr(cpu_linear, "invariant_form", lambda weight: "packed")
    monkeypatch.setattr(cpu_linear, "_streamed_seconds", lambda weight, rows: seconds)
    assert cpu_linear.few_row_form(torch.zeros(8, 4), 2) == chosen


def test_the_forms_are_timed_over_copies_that_fill_the_streamed_bytes(monkeypatch):
    """Timed over one weight again and again, a form reads it from the cache, not from memory
    as a large model's step does: the timing takes as many copies as fill STREAMED_BYTES."""
    from selfspec.model import cpu_linear

    seen = []
    monkeypatch.setattr(cpu_linear, "STREAMED_BYTES", 10 * 64 * 32 * 4)
    monkeypatch.setattr(cpu_linear, "_few_row_product",
                        lambda form, x, w, packed: seen.append((form, w.data_ptr())))
    seconds = cpu_linear._streamed_seconds(torch.zeros(64, 32), 1)
    assert set(seconds) <= set(cpu_linear.FEW_ROW_FORMS) and "mkl" in seconds
    runs = 4  # one untimed, three timed
    assert len(seen) == len(seconds) * runs * 10
    assert len({ptr for _, ptr in seen}) == 10  # ten weights, each read in turn


def test_a_form_whose_rows_depend_on_their_company_is_not_taken(monkeypatch):
    """Planted forms whose bits change with the row count are passed over, in the probe's
    order: elementwise (small weights only), `W @ x.T`, the packed product; with all three
    planted, it warns and keeps `W @ x.T`."""
    from selfspec.model import cpu_linear

    def company(rows, weight):  # one ulp's worth more for every row beside the first
        return (weight @ rows.t()).t() * (1 + 1e-7 * (rows.shape[0] > 1))

    monkeypatch.setattr(cpu_linear, "_transposed", company)
    assert cpu_linear._probe_invariant_form(64, 48) == "elementwise"  # each output on its own
    assert cpu_linear._probe_invariant_form(128, 256) == "packed"  # too large for elementwise
    monkeypatch.setattr(cpu_linear, "_elementwise", company)
    assert cpu_linear._probe_invariant_form(64, 48) == "packed"
    monkeypatch.setattr(cpu_linear, "_packed_product", lambda rows, packed: company(
        rows, torch.ones(64, 48)))
    assert cpu_linear._probe_invariant_form(64, 48) == "transposed"


def test_the_elementwise_form_is_linear_up_to_rounding_and_only_without_autograd():
    from selfspec.model import cpu_linear

    torch.manual_seed(0)
    weight, x = torch.randn(64, 48), torch.randn(5, 48)
    with torch.no_grad():
        torch.testing.assert_close(cpu_linear._elementwise(x, weight),
                                   torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-5)
    if cpu_linear.invariant_form(weight) == "elementwise":
        trained = cpu_linear.linear(x.requires_grad_(), weight)
        assert trained.grad_fn is not None and "Sum" not in type(trained.grad_fn).__name__
