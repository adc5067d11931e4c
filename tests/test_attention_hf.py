"""transformers models with attn_implementation="ipex_train" (ipex_train.integrations.hf_attention) against the same
models with "sdpa", and packed batches (position ids restarting at 0, as DataCollatorWithFlattening makes them)
against each document run alone.

Tolerances: both runs are bf16 models; ipex_train's attention and torch's bf16 attention round differently (the
probabilities to bf16 before P V here), so logits agree to 3% of their largest magnitude and parameter gradients to
10% of each gradient's largest magnitude (one backward through two layers; measured: < 2% and < 4%); a model
attending across documents or to padding differs by far more in the documents' logits.
"""
import pytest
import torch

from ipex_train import attention

transformers = pytest.importorskip("transformers")
from ipex_train.integrations import hf_attention  # noqa: E402  (registers "ipex_train")

BF16 = torch.bfloat16
FAMILIES = ("llama", "qwen2", "mistral")


def _config(family, implementation):
    common = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, attn_implementation=implementation)
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "qwen2":
        return transformers.Qwen2Config(**common)
    return transformers.MistralConfig(sliding_window=None, **common)


def _model(family, implementation):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(family, implementation))
    return model.to(BF16).train()


def _grads(model):
    return {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _run(model, **inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.logits.float().square().mean().backward()
    return out.logits.detach().float(), _grads(model)


def _close(got, want, tol):
    err = (got - want).abs().max().item()
    assert err <= tol * want.abs().max().item() + 1e-3, (err, want.abs().max().item())


@pytest.mark.parametrize("family", FAMILIES)
def test_same_as_sdpa(family):
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(1))
    ours = _model(family, "ipex_train")
    assert ours.config._attn_implementation == "ipex_train"
    logits, grads = _run(ours, input_ids=ids)
    ref_logits, ref_grads = _run(_model(family, "sdpa"), input_ids=ids)
    _close(logits, ref_logits, 3e-2)
    for n, g in ref_grads.items():
        _close(grads[n], g, 0.1)


def test_padding_mask_same_as_sdpa():
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, 30:] = 0  # right padding
    ours, _ = _run(_model("llama", "ipex_train"), input_ids=ids, attention_mask=mask)
    ref, _ = _run(_model("llama", "sdpa"), input_ids=ids, attention_mask=mask)
    _close(ours[0], ref[0], 3e-2)
    _close(ours[1, :30], ref[1, :30], 3e-2)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_batch_equals_documents_alone(family):
    lengths = [7, 30, 1, 22]
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(0, 64, (1, n), generator=g) for n in lengths]
    ids = torch.cat(docs, dim=1)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    model = _model(family, "ipex_train")
    packed = model(input_ids=ids, position_ids=position_ids).logits.float()
    alone = torch.cat([model(input_ids=d).logits.float() for d in docs], dim=1)
    _close(packed, alone, 3e-2)
    # Cumulative lengths (flash-attention kwargs) give the same bits as the position ids.
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    with_cu = model(input_ids=ids, position_ids=position_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                    max_length_q=max(lengths), max_length_k=max(lengths)).logits.float()
    assert torch.equal(with_cu, packed)


def test_packed_gradients_equal_documents_alone():
    lengths = [12, 50, 3]
    g = torch.Generator().manual_seed(4)
    docs = [torch.randint(0, 64, (1, n), generator=g) for n in lengths]
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    model = _model("llama", "ipex_train")
    _, packed = _run(model, input_ids=torch.cat(docs, dim=1), position_ids=position_ids)
    model.zero_grad(set_to_none=True)
    total = sum(model(input_ids=d).logits.float().square().sum() for d in docs) / (sum(lengths) * 64)
    total.backward()
    alone = _grads(model)
    for n, grad in alone.items():
        _close(packed[n], grad, 0.1)


def test_sliding_window_same_as_sdpa():
    def run(implementation):
        torch.manual_seed(0)
        config = _config("mistral", implementation)
        config.sliding_window = 16
        return transformers.AutoModelForCausalLM.from_config(config).to(BF16)(input_ids=ids).logits.float()

    ids = torch.randint(0, 64, (1, 60), generator=torch.Generator().manual_seed(5))
    _close(run("ipex_train"), run("sdpa"), 3e-2)


@pytest.mark.skipif(not attention._bf16_dot_in_use(),
                    reason="the tiled kernel runs on AVX-512 BF16 with the avx512 kernel variant only")
def test_packed_documents_run_on_the_tiled_kernel():
    calls = []
    original = attention._op.flash_forward

    def spy(*args):
        calls.append(args[4])
        return original(*args)

    attention._packed._op.flash_forward = spy
    try:
        model = _model("qwen2", "ipex_train")
        position_ids = torch.cat([torch.arange(10), torch.arange(6)]).unsqueeze(0)
        model(input_ids=torch.zeros(1, 16, dtype=torch.long), position_ids=position_ids)
    finally:
        attention._packed._op.flash_forward = original
    assert len(calls) == 2 and all(c is not None and c[0, 12].item() == 10 for c in calls)


def test_register_under_another_name():
    hf_attention.register("ipex_train_copy")
    assert transformers.AttentionInterface._global_mapping["ipex_train_copy"] \
        is hf_attention.ipex_train_attention_forward
