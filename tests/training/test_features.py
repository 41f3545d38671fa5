"""The feature store (training/features.py): batched shards equal one-row forwards, resume
after a kill, refusals, fp8's rounding, and objectives trained from a store."""

import json
import os

import pytest
import torch
from helpers import tiny_llama

from selfspec import Transformer
from selfspec.training.features import (
    INDEX,
    FeatureStore,
    StoredFeatures,
    StoreWriter,
    build_store,
    data_key,
    decode,
    encode,
    store_spec,
)
from selfspec.training.rows import TokenRows

LAYERS = (0, 1)  # the embeddings and the residual after layer 1 of the 2-layer toy target


@pytest.fixture(scope="module")
def target() -> Transformer:
    return Transformer.from_hf(tiny_llama(0))


def rows(n: int = 7, length: int = 12, seed: int = 0) -> TokenRows:
    tokens = torch.randint(2, 64, (n, length), generator=torch.Generator().manual_seed(seed))
    mask = (torch.arange(length) >= 3).long().expand(n, length).clone()
    return TokenRows(tokens, mask)


def write(target, folder, data: TokenRows, dtype="fp32", **options) -> FeatureStore:
    writer = StoreWriter(folder, store_spec(target, LAYERS, dtype, data_key(data.tokens)))
    names = build_store(target, data, writer, prefix="train", progress=False, **options)
    assert writer.finish(names) is not None
    return FeatureStore(folder)


def one_row_states(target, row: torch.Tensor):
    out = target(row[None], torch.arange(row.shape[0]), return_hidden=LAYERS)
    return out.last_hidden[0], [h[0] for h in out.hidden]


def test_a_store_made_in_batches_equals_one_row_forwards(target, tmp_path):
    data = rows()
    store = write(target, tmp_path / "store", data, batch_size=3, rows_per_shard=4)
    assert [s.rows for s in store.index.shards] == [4, 3]  # shards cut across batches
    assert store.index.rows == 7 and store.index.tokens == 7 * 12
    assert store.index.supervised_tokens == int(data.loss_mask.sum())
    stored = store.read(data.tokens, LAYERS, torch.float32)
    for b, row in enumerate(data.tokens):
        last, streams = one_row_states(target, row)
        torch.testing.assert_close(stored.last[b], last)  # what the LM head reads
        for got, expected in zip(stored.streams, streams, strict=True):
            torch.testing.assert_close(got[b], expected)
    shuffled = data.tokens[[6, 0, 3]]  # rows are found by their tokens, in any order
    torch.testing.assert_close(store.read(shuffled, (1,), torch.float32).streams[0],
                               stored.streams[1][[6, 0, 3]])


def test_the_index_lists_the_shards_with_their_sizes_and_fingerprints(target, tmp_path):
    store = write(target, tmp_path / "store", rows(), dtype="bf16", rows_per_shard=4)
    index = json.loads((tmp_path / "store" / INDEX).read_text())
    assert index["spec"]["layers"] == list(LAYERS) and index["spec"]["dtype"] == "bf16"
    assert index["data_fingerprint"] == data_key(rows().tokens)
    assert [(s["file"], s["rows"]) for s in index["shards"]] == [
        ("train-00000000.safetensors", 4), ("train-00000004.safetensors", 3)]
    for shard in index["shards"]:
        assert (tmp_path / "store" / shard["file"]).stat().st_size == shard["bytes"]
    assert store.read(rows().tokens[:1], (), torch.float32).last.dtype == torch.float32


def test_a_killed_store_is_never_taken_for_finished_and_resumes(target, tmp_path, monkeypatch):
    data, folder = rows(n=10), tmp_path / "store"
    spec = store_spec(target, LAYERS, "fp32", data_key(data.tokens))
    writes = []
    real_write = StoreWriter.write

    def dies_on_the_third_shard(self, name, part, states):
        if len(writes) == 2:
            raise KeyboardInterrupt  # killed midway
        writes.append(name)
        real_write(self, name, part, states)

    monkeypatch.setattr(StoreWriter, "write", dies_on_the_third_shard)
    with pytest.raises(KeyboardInterrupt):
        build_store(target, data, StoreWriter(folder, spec), prefix="train", rows_per_shard=3,
                    progress=False)
    monkeypatch.setattr(StoreWriter, "write", real_write)
    with pytest.raises(FileNotFoundError, match="cut short; run the store command again"):
        FeatureStore(folder)
    dead = folder / f"train-00000006.safetensors.{2**22 + 1}.partial"  # a dead run's file
    dead.write_bytes(b"half a shard")
    forwards = []
    hook = target.register_forward_hook(lambda m, args, out: forwards.append(args[0].shape[0]))
    try:
        writer = StoreWriter(folder, spec)
        names = build_store(target, data, writer, prefix="train", rows_per_shard=3,
                            batch_size=8, progress=False)
    finally:
        hook.remove()
    assert not dead.exists()
    assert forwards == [3, 1]  # only the two missing shards ran
    writer.finish(names)
    whole = write(target, tmp_path / "whole", data, rows_per_shard=3)
    resumed = FeatureStore(folder)
    assert resumed.index == whole.index  # the same shards, sizes and fingerprints
    torch.testing.assert_close(resumed.read(data.tokens, LAYERS, torch.float32).streams[1],
                               whole.read(data.tokens, LAYERS, torch.float32).streams[1],
                               rtol=0, atol=0)


def test_a_shard_cut_short_or_lost_is_refused(target, tmp_path):
    write(target, tmp_path / "store", rows(), rows_per_shard=4)
    shard = tmp_path / "store" / "train-00000004.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ValueError, match="is 100 bytes, not the .* bytes index.json lists"):
        FeatureStore(tmp_path / "store")
    shard.unlink()
    with pytest.raises(ValueError, match="train-00000004.safetensors is missing"):
        FeatureStore(tmp_path / "store")


def test_a_store_of_other_weights_rows_or_layers_is_refused(target, tmp_path):
    data = rows()
    store = write(target, tmp_path / "store", data)
    store.check(target, [data], LAYERS)
    store.check(target, [data.select(torch.arange(3))], (1,))  # a subset of its rows
    other = Transformer.from_hf(tiny_llama(1))
    with pytest.raises(ValueError, match="built from other target weights .* build it again"):
        store.check(other, [data], LAYERS)
    with pytest.raises(ValueError, match=r"lacks 2 of the run's 9 rows .* data fingerprint"):
        store.check(target, [data, rows(n=2, seed=5)], LAYERS)
    with pytest.raises(ValueError, match=r"holds layers \[0, 1\], not \[2\]"):
        store.check(target, [data], (2,))
    with pytest.raises(ValueError, match="holds a feature store of another dtype"):
        StoreWriter(tmp_path / "store", store_spec(target, LAYERS, "bf16",
                                                   data_key(data.tokens)))


def test_fp8_keeps_each_value_within_its_rounding_and_halves_bf16(target, tmp_path):
    generator = torch.Generator().manual_seed(0)
    magnitudes = 10.0 ** torch.linspace(-3, 3, 24)[:, None]  # tokens of very different sizes
    x = torch.randn(24, 64, generator=generator) * magnitudes  # [T, H]
    x[5] = 0  # an all-zero token
    stored, scale = encode(x, "fp8")
    assert stored.dtype == torch.float8_e4m3fn and scale.shape == (24,)
    back = decode(stored, scale, torch.float32)
    # e4m3 keeps 3 mantissa bits: half a step is 2**-4 of a normal value, 2**-10 of the
    # scale below e4m3's smallest normal
    bound = 2**-4 * x.abs() + 2**-10 * scale[:, None]
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()
    assert (back[5] == 0).all() and back.isfinite().all()
    assert (back - x).abs().max() > 0  # it does round
    bf16, _ = encode(x, "bf16")
    torch.testing.assert_close(decode(bf16, None, torch.float32), x, rtol=2**-8, atol=0)
    sizes = {}
    for dtype in ("bf16", "fp8"):
        write(target, tmp_path / dtype, rows(n=4, length=64), dtype=dtype)
        sizes[dtype] = sum(f.stat().st_size for f in (tmp_path / dtype).glob("*.safetensors"))
    assert sizes["fp8"] < 0.7 * sizes["bf16"]


def test_two_runs_sharing_a_folder_write_each_shard_once(target, tmp_path):
    data, folder = rows(n=6), tmp_path / "store"
    spec = store_spec(target, LAYERS, "fp32", data_key(data.tokens))
    first, second = StoreWriter(folder, spec), StoreWriter(folder, spec)
    names = build_store(target, data, first, prefix="train", rows_per_shard=2, rank=0, world=2,
                        progress=False)
    assert first.finish(names) is None  # rank 1's shard is missing: no index yet
    assert not (folder / INDEX).exists()
    written = {n: first.path(n).stat().st_mtime_ns for n in names if first.done(n)}
    build_store(target, data, second, prefix="train", rows_per_shard=2, progress=False)
    assert {n: first.path(n).stat().st_mtime_ns for n in written} == written  # kept
    assert second.finish(names) is not None
    assert FeatureStore(folder).index.rows == 6


def test_stored_features_read_in_the_targets_dtype_on_the_tokens_device(target, tmp_path):
    data = rows()
    store = write(target, tmp_path / "store", data, dtype="bf16")
    states = StoredFeatures(store, (1,)).states(target, data.tokens[:2])
    assert states.last.dtype == torch.float32 and len(states.streams) == 1
    last, streams = one_row_states(target, data.tokens[0])
    torch.testing.assert_close(states.streams[0][0], streams[1], rtol=2**-7, atol=1e-2)
    with pytest.raises(ValueError, match=r"lacks layers \[3\]"):
        StoredFeatures(store, (3,))
    with pytest.raises(ValueError, match="a row is not in the feature store"):
        store.read(rows(n=1, seed=9).tokens, (), torch.float32)


def test_the_claim_is_written_before_any_shard(target, tmp_path):
    spec = store_spec(target, LAYERS, "fp8", "x")
    StoreWriter(tmp_path / "store", spec)
    assert json.loads((tmp_path / "store" / "store.json").read_text())["dtype"] == "fp8"
    assert not any(name.endswith(".safetensors") for name in os.listdir(tmp_path / "store"))
    with pytest.raises(ValueError, match=r"store layers \[5\] lie outside \[0, 2\]"):
        store_spec(target, (5,), "bf16", "x")
    with pytest.raises(ValueError, match="store dtype must be one of fp32, bf16, fp8"):
        store_spec(target, (), "fp16", "x")


# ---- training from a store -------------------------------------------------------------------


def objective(method: str, target, features):
    """A fresh objective of `method` over the toy target, its trainable weights seeded alike
    each time, reading the target's states from `features` (None: its forward)."""
    from helpers import (
        EAGLE3_LAYERS,
        eagle_head_config,
        first_layers,
        random_eagle_head,
        random_exit,
        reduced_medusa_heads,
    )

    from selfspec.from_config.methods.eagle import Eagle3Objective, EagleObjective
    from selfspec.from_config.methods.early_exit import EarlyExitObjective
    from selfspec.from_config.methods.medusa import MedusaObjective
    from selfspec.from_config.methods.small_model import DraftModelObjective

    source = None if features is None else StoredFeatures(features, {
        "eagle3": EAGLE3_LAYERS, "early_exit": (1,)}.get(method, ()))
    torch.manual_seed(3)
    if method == "medusa":
        return MedusaObjective(target, reduced_medusa_heads(target, list(range(0, 64, 2)), 2),
                               features=source)
    if method == "eagle1":
        return EagleObjective(target, random_eagle_head(eagle_head_config(target, 1), 3),
                              feature_noise=0.1, features=source,
                              generator=torch.Generator().manual_seed(4))
    if method == "eagle3":
        return Eagle3Objective(target, random_eagle_head(eagle_head_config(target, 3), 3),
                               steps=2, features=source)
    if method == "early_exit":
        return EarlyExitObjective(target, [random_exit(target, 1, "adapter")], features=source)
    draft = Transformer.from_hf(first_layers(tiny_llama(0), 1))
    draft.lm_head.requires_grad_(False)
    return DraftModelObjective(target, draft, features=source)


def train_losses(objective, data: TokenRows, steps: int, lr: float = 1e-2) -> list[float]:
    """The loss of each of `steps` AdamW steps over batches of 4 rows in a fixed order."""
    objective.train()
    trainable = [p for p in objective.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr)
    losses = []
    for step in range(steps):
        batch = data.select(torch.arange(step * 4, step * 4 + 4) % len(data))
        out = objective(batch.tokens, batch.loss_mask)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        losses.append(float(out.loss.detach()))
    return losses


def held_loss(objective, data: TokenRows) -> float:
    """The loss over every row at once, in eval mode (no feature noise)."""
    objective.eval()
    with torch.no_grad():
        return float(objective(data.tokens, data.loss_mask).loss)


METHODS = ["medusa", "eagle1", "eagle3", "early_exit", "draft"]


@pytest.fixture(scope="module")
def training_store(target, tmp_path_factory):
    from helpers import EAGLE3_LAYERS

    data = rows(n=8, length=16)
    writer = StoreWriter(tmp_path_factory.mktemp("store"),
                         store_spec(target, EAGLE3_LAYERS, "fp32", data_key(data.tokens)))
    writer.finish(build_store(target, data, writer, prefix="train", batch_size=4,
                              progress=False))
    return data, FeatureStore(writer.folder)


@pytest.mark.parametrize("method", METHODS)
def test_steps_from_an_fp32_store_have_the_losses_of_online_training(method, target,
                                                                      training_store):
    data, store = training_store
    online = train_losses(objective(method, target, None), data, steps=3)
    stored = train_losses(objective(method, target, store), data, steps=3)
    assert stored == pytest.approx(online, rel=1e-5)
    assert len(set(online)) == 3  # the weights moved between steps


@pytest.mark.parametrize("method", METHODS)
def test_training_from_a_store_lowers_the_loss_without_running_the_target(method, target,
                                                                           training_store):
    data, store = training_store
    trained = objective(method, target, store)
    layer_calls = []
    hooks = [layer.register_forward_hook(lambda *args: layer_calls.append(1))
             for layer in target.layers]
    try:
        before = held_loss(trained, data)
        train_losses(trained, data, steps=16)
        after = held_loss(trained, data)
    finally:
        for hook in hooks:
            hook.remove()
    assert not layer_calls  # the target's layers never ran
    assert after < 0.95 * before
