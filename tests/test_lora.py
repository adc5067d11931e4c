"""LoRA / peft under optimize(): frozen parameters cost only what their values need, adapters train with their fp32
truth, save/reload in peft, merge_and_unload, the frozen_weights opt-in and HF Trainer + peft resume.

A tiny Llama built from a config (GQA, RMSNorm, rotary, tied embeddings); a few steps each."""
import json
import warnings

import pytest
import torch

import ipex_train

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 128, 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
LR = 1e-2


def llama(dtype=torch.float32, seed=0):
    """The tiny Llama, its weights drawn from ``seed`` then cast to ``dtype`` (as from_pretrained(dtype=) gives)."""
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                   tie_word_embeddings=True, initializer_range=0.1)  # a base LoRA can steer
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).to(dtype)


def lora(model, seed=1):
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                       init_lora_weights="gaussian"))
    return m.train()


def batch(seed=2, n=4):
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    return (start + torch.arange(SEQ)) % VOCAB  # learnable: each token follows the previous one


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def train(model, opt, steps, ids):
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def optimized_lora(dtype=torch.bfloat16, **kwargs):
    model = lora(llama(dtype))
    return ipex_train.optimize(model, torch.optim.AdamW(trainable(model), lr=LR), dtype=torch.bfloat16,
                               inplace=True, **kwargs)


def base_state(model):
    return {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}


def test_lora_on_bf16_base_trains_like_torch_and_keeps_the_base():
    model, opt = optimized_lora()
    before = base_state(model)
    adapters = {k: v.clone() for k, v in model.state_dict().items() if "lora_B" in k}
    ids = batch()
    losses = train(model, opt, 8, ids)
    # Plain torch on the same bf16 base with fp32 adapters (what peft makes): the reference curve.
    ref = lora(llama(torch.bfloat16))
    ref_losses = train(ref, torch.optim.AdamW(trainable(ref), lr=LR), 8, ids)
    assert losses[-1] < 0.75 * losses[0], losses
    assert losses == pytest.approx(ref_losses, rel=0.02), (losses, ref_losses)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) and after[k].dtype == v.dtype for k, v in before.items())
    assert all(not torch.equal(after[k], v) for k, v in adapters.items())
    assert all(after[k].dtype == torch.float32 for k in adapters)  # the adapters' fp32 truth


def test_frozen_bf16_weights_get_no_residual():
    model, opt = optimized_lora()
    report = ipex_train.memory_report(model, opt)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert report.frozen_parameters == sum(p.numel() for p in frozen) > 0
    # Plain torch holds 2 bytes per frozen bf16 parameter; optimize() adds nothing to it.
    assert report.per_frozen()["total"] - 2.0 <= 0.05
    assert report.frozen_truth == 0
    masters = model._ipex_train_masters
    assert not any(p in masters.aux for p in frozen)
    assert all(p in masters.aux for p in trainable(model))  # the adapters: split bf16 with their residual
    assert report.per_trainable() == pytest.approx(2 + 2 + 2 + 8)  # top, residual, bf16 grad, fp32 AdamW state
    assert "frozen at 2.00 bytes/param" in str(report)
    summary = ipex_train.summary(model, opt)
    assert summary.frozen_tensors == len(frozen)
    assert summary.frozen_without_truth_elements == summary.frozen_elements
    assert "frozen_weights=lossless" in str(summary)
    json.dumps(report.to_dict()) and json.dumps(summary.to_dict())


def test_state_not_predicted_for_frozen_params_in_the_optimizer():
    model = lora(llama(torch.bfloat16))
    model, opt = ipex_train.optimize(model, torch.optim.AdamW(model.parameters()), dtype=torch.bfloat16,
                                     inplace=True)
    n = sum(p.numel() for p in trainable(model))
    assert ipex_train.memory_report(model, opt).state_predicted == 8 * n


def test_frozen_fp32_is_lossless_by_default():
    model = lora(llama())
    want = base_state(model)
    model, opt = ipex_train.optimize(model, torch.optim.AdamW(trainable(model)), dtype=torch.bfloat16,
                                     inplace=True)
    report = ipex_train.memory_report(model, opt)
    assert report.per_frozen()["truth"] == pytest.approx(2.0, abs=0.05)  # int16 residuals (norms stay fp32)
    got = model.state_dict()
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in want.items())


def test_frozen_weights_low_precision_opt_in():
    model = lora(llama())
    want = base_state(model)
    model, opt = ipex_train.optimize(model, torch.optim.AdamW(trainable(model), lr=1e-2), dtype=torch.bfloat16,
                                     inplace=True, frozen_weights="low_precision")
    report = ipex_train.memory_report(model, opt)
    assert report.frozen_truth == 0 and report.per_frozen()["total"] <= 2.05
    assert "frozen_weights=low_precision" in str(ipex_train.summary(model, opt))
    got = model.state_dict()
    q = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    # state_dict holds the rounded bf16 value of such a weight (its fp32 bits are gone).
    assert got[q].dtype == torch.bfloat16 and torch.equal(got[q], want[q].to(torch.bfloat16))
    norm = "base_model.model.model.norm.weight"
    assert got[norm].dtype == torch.float32 and torch.equal(got[norm], want[norm])  # fp32 norms stay fp32
    train(model, opt, 2, batch())
    # Unfreezing such a weight cannot train it: the step refuses before stepping anything.
    weight = model.get_submodule(q.removesuffix(".weight")).weight
    weight.requires_grad_(True)
    opt.add_param_group({"params": [weight]})
    adapters = {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}
    opt.zero_grad()
    model(input_ids=batch(), labels=batch()).loss.backward()
    with pytest.raises(RuntimeError, match="q_proj.*frozen_weights='low_precision'"):
        opt.step()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in adapters.items())


def test_frozen_weights_validated_at_the_boundary():
    model = lora(llama())
    opt = torch.optim.AdamW(trainable(model))
    with pytest.raises(ValueError, match="frozen_weights='bf16'.*lossless, low_precision"):
        ipex_train.optimize(model, opt, dtype=torch.bfloat16, frozen_weights="bf16")
    with pytest.raises(TypeError, match="frozen_weights"):
        ipex_train.optimize(model, opt, dtype=torch.bfloat16, frozen_weights=True)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # nothing changed
    assert ipex_train.OptimizeConfig.from_env({"IPEX_TRAIN_FROZEN_WEIGHTS": "low_precision"}).frozen_weights \
        == "low_precision"
    assert ipex_train.OptimizeConfig(frozen_weights="lossless").frozen_weights is None


def test_unfrozen_bf16_weight_gets_its_truth_at_first_step():
    model = lora(llama(torch.bfloat16))
    model, opt = ipex_train.optimize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), dtype=torch.bfloat16,
                                     inplace=True)
    emb = model.get_input_embeddings().weight
    masters = model._ipex_train_masters
    assert emb not in masters.aux
    emb.requires_grad_(True)
    ref = emb.detach().float().clone()
    train(model, opt, 2, batch())
    assert emb in masters.aux and emb.dtype == torch.bfloat16
    saved = model.state_dict()["base_model.model.model.embed_tokens.weight"]
    assert saved.dtype == torch.float32 and not torch.equal(saved, ref)
    assert torch.equal(saved, masters.fp32(emb)) and masters.is_split(emb)


@pytest.fixture
def trained():
    model, opt = optimized_lora()
    train(model, opt, 4, batch())
    return model.eval()


def test_adapter_save_reload_in_peft(trained, tmp_path):
    ids = batch(seed=5)
    trained.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert saved and all(v.dtype == torch.float32 for v in saved.values())
    reloaded = peft.PeftModel.from_pretrained(llama(torch.bfloat16), tmp_path).eval()
    truth = {k: v for k, v in trained.state_dict().items() if "lora_" in k}
    for k, v in reloaded.state_dict().items():
        if "lora_" in k:
            assert torch.equal(v, truth[k])
    with torch.no_grad():
        got, want = reloaded(input_ids=ids).logits.float(), trained(input_ids=ids).logits.float()
    # The optimized model computes with bf16 adapter tops, the reloaded one with fp32 adapters; and its attention is
    # ipex_train's bf16 attention where the native policy routes it, torch's in the reloaded one (both round scores
    # and probabilities to bf16, at different points: one logit of 8192 differed by 0.053).
    torch.testing.assert_close(got, want, atol=0.08, rtol=0.02)


def test_merge_and_unload(trained):
    ids = batch(seed=5)
    with torch.no_grad():
        want = trained(input_ids=ids).logits.float()
        merged = trained.merge_and_unload()
        assert not any("lora_" in k for k in merged.state_dict())
        got = merged(input_ids=ids).logits.float()
    torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)


class _Ids(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = batch(seed=3, n=32)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer(out, steps):
    model = lora(llama(torch.bfloat16))
    model, opt = ipex_train.optimize(model, torch.optim.AdamW(trainable(model), lr=1e-2), dtype=torch.bfloat16,
                                     inplace=True)
    sched = transformers.get_linear_schedule_with_warmup(opt, 1, steps)
    args = transformers.TrainingArguments(str(out), per_device_train_batch_size=4, max_steps=steps, save_steps=2,
                                          use_cpu=True, report_to=[], disable_tqdm=True, seed=0, logging_steps=1)
    return transformers.Trainer(model=model, args=args, train_dataset=_Ids(), optimizers=(opt, sched))


def test_trainer_with_peft_resumes_exactly(tmp_path):
    full = _trainer(tmp_path, 4)
    full.train()
    want = {k: v for k, v in full.model.state_dict().items() if "lora_" in k}
    resumed = _trainer(tmp_path / "again", 4)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    got = resumed.model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())
    first = _trainer(tmp_path / "fresh", 4).model.state_dict()
    assert any(not torch.equal(first[k], v) for k, v in want.items())  # the adapters did train
