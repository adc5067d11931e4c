"""ipex_train's drop-in HF Trainer (``ipex_train.integrations.transformers.Trainer``): ``bf16=True`` trains exactly
as the manual route (optimize() by hand, then the stock Trainer with the same parameter groups and scheduler), the
stock Trainer's parameter groups and ``optim=`` classes, resume from a mid-run checkpoint bit for bit, evaluation,
peft, optimize() options through ``optimize_config``, and the refused settings."""
from __future__ import annotations

import logging

import pytest
import torch

import ipex_train

transformers = pytest.importorskip("transformers")
from ipex_train.integrations.transformers import Trainer  # noqa: E402

BF16 = torch.bfloat16
VOCAB = 48


def tiny_bert():
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def tiny_llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=16))


class Data(torch.utils.data.Dataset):
    def __init__(self, n=16, causal=False, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, 8), generator=g)
        self.causal = causal

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i] if self.causal else self.ids[i, 0] % 3}


def targs(out, **kw):
    base = dict(per_device_train_batch_size=4, max_steps=4, learning_rate=1e-2, weight_decay=0.1, use_cpu=True,
                report_to=[], disable_tqdm=True, seed=0, save_strategy="no", logging_steps=1)
    return transformers.TrainingArguments(str(out), **{**base, **kw})


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_same(got, want):
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused", "sgd", "adagrad"])
def test_parameter_groups_and_optim_as_stock(tmp_path, optim):
    """The optimizer's groups are the stock Trainer's (same parameters by name, same decay split and
    hyperparameters), its class the one optim= names, stepped by a fused kernel."""
    stock = transformers.Trainer(model=tiny_bert(), args=targs(tmp_path, optim=optim))
    ours = Trainer(model=tiny_bert(), args=targs(tmp_path, optim=optim, bf16=True))
    want, got = stock.create_optimizer(), ours.create_optimizer()
    assert isinstance(got, type(want)) and got is ours.optimizer
    for gw, gg in zip(want.param_groups, got.param_groups, strict=True):
        assert [_name(stock.model, p) for p in gw["params"]] == [_name(ours.model, p) for p in gg["params"]]
        assert {k: v for k, v in gw.items() if k != "params"} == {k: v for k, v in gg.items() if k != "params"}
    assert any(g["weight_decay"] == 0.0 and g["params"] for g in got.param_groups)  # biases and norms
    assert ours.model.bert.embeddings.word_embeddings.weight.dtype == BF16
    assert ipex_train.summary(ours.model, got).fused_step is not None


def _name(model, p):
    return next(n for n, q in model.named_parameters() if q is p)


def test_unfused_optim_logs_and_trains(tmp_path, caplog):
    t = Trainer(model=tiny_bert(), args=targs(tmp_path, optim="rmsprop", bf16=True, max_steps=2),
                train_dataset=Data())
    with caplog.at_level(logging.WARNING, logger="ipex_train"):
        t.train()
    assert any("optim='rmsprop'" in r.getMessage() and "no fused step" in r.getMessage() for r in caplog.records)
    assert isinstance(t.optimizer.optimizer, torch.optim.RMSprop)


def test_bf16_trains_exactly_as_the_manual_route(tmp_path):
    """bf16=True with accumulation, clipping and the Trainer's warm-up scheduler: the same losses and weights,
    bit for bit, as optimize() by hand + stock Trainer (no autocast on either)."""
    kw = dict(gradient_accumulation_steps=2, max_grad_norm=0.5, warmup_steps=2, lr_scheduler_type="linear",
              max_steps=5)
    ours = Trainer(model=tiny_bert(), args=targs(tmp_path / "a", bf16=True, **kw), train_dataset=Data(24))
    ours.train()

    model = tiny_bert().train()
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    groups = [{"params": [p for n, p in model.named_parameters() if n in decay], "weight_decay": 0.1},
              {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.999), eps=1e-8)
    model, opt = ipex_train.optimize(model, opt, dtype=BF16, inplace=True)
    sched = transformers.get_linear_schedule_with_warmup(opt, 2, 5)
    manual = transformers.Trainer(model=model, args=targs(tmp_path / "b", **kw), train_dataset=Data(24),
                                  optimizers=(opt, sched))
    manual.train()

    assert ours.accelerator.mixed_precision == "no"
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (ours, manual)]
    assert losses[0] == losses[1] and len(losses[0]) == 5
    assert_same(ours.model.state_dict(), manual.model.state_dict())
    lrs = [[h["learning_rate"] for h in t.state.log_history if "learning_rate" in h] for t in (ours, manual)]
    assert lrs[0] == lrs[1] and lrs[0][0] < lrs[0][1]  # the warm-up ran


def test_resume_from_mid_run_checkpoint_is_exact(tmp_path):
    def trainer():
        return Trainer(model=tiny_llama(), args=targs(tmp_path, bf16=True, max_steps=4, save_strategy="steps",
                                                      save_steps=2), train_dataset=Data(16, causal=True))

    first = trainer()
    first.train()
    want = state(first.model)
    first.save_model(tmp_path / "final")
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "final")
    assert_same(reloaded.state_dict(), want)  # fp32, exact, in vanilla transformers

    second = trainer()
    second.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert_same(second.model.state_dict(), want)
    assert second.model.model.embed_tokens.weight.dtype == BF16


def test_evaluate_before_and_after_training(tmp_path):
    data = Data(16, causal=True)
    fp32 = transformers.Trainer(model=tiny_llama(), args=targs(tmp_path)).evaluate(data)["eval_loss"]
    t = Trainer(model=tiny_llama(), args=targs(tmp_path, bf16=True, max_steps=6), train_dataset=data)
    before = t.evaluate(data)["eval_loss"]
    assert t.model.model.embed_tokens.weight.dtype == BF16 and not t.model.training  # converted, mode kept
    assert before == pytest.approx(fp32, rel=2e-2)  # bf16 computation of the same fp32 weights
    start = state(t.model)
    assert_same(start, {k: v for k, v in tiny_llama().state_dict().items()})  # converting lost nothing
    t.train()
    after = t.evaluate(data)["eval_loss"]
    assert after < before - 0.05
    with torch.no_grad():  # the evaluation ran the trained bf16 model as it is (no autocast, no copy)
        direct = t.model.eval()(input_ids=data.ids, labels=data.ids).loss
    assert direct.dtype == torch.float32 and after == pytest.approx(float(direct), rel=1e-3)


def test_peft_lora_trains_and_resumes_exactly(tmp_path):
    peft = pytest.importorskip("peft")

    def trainer():
        model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                  lora_dropout=0.0))
        return Trainer(model=model, args=targs(tmp_path, bf16=True, max_steps=4, save_strategy="steps",
                                               save_steps=2, learning_rate=5e-2),
                       train_dataset=Data(16, causal=True))

    first = trainer()
    before = state(first.model)
    first.train()
    trained = [n for n, p in first.model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)
    in_opt = {id(p) for g in first.optimizer.param_groups for p in g["params"]}
    assert in_opt == {id(p) for n, p in first.model.named_parameters() if p.requires_grad}
    after = state(first.model)
    assert all(torch.equal(after[k], v) == ("lora_" not in k) for k, v in before.items())  # only adapters moved
    second = trainer()
    second.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert_same(second.model.state_dict(), after)


def test_optimize_options_through_optimize_config(tmp_path):
    config = ipex_train.OptimizeConfig(step_in_backward=True, optimizer_state_dtype=BF16)
    t = Trainer(model=tiny_bert(), args=targs(tmp_path, bf16=True, max_steps=3, max_grad_norm=0),
                train_dataset=Data(), optimize_config=config)
    assert t.optimize_config.step_in_backward and t.optimize_config.dtype == BF16
    before = state(t.model)
    t.train()
    opt = t.optimizer.optimizer
    assert opt.step_in_backward and all(g["state_dtype"] == BF16 for g in opt.param_groups)
    assert all(p.grad is None for p in t.model.parameters())
    after = t.model.state_dict()
    assert all(not torch.equal(after[k], v) for k, v in before.items() if v.is_floating_point() and v.numel() > 16)


@pytest.mark.parametrize("kw, config, match", [
    (dict(fp16=True), None, r"fp16=True"),
    (dict(bf16=True, bf16_full_eval=True), None, r"bf16_full_eval"),
    (dict(bf16=True), ipex_train.OptimizeConfig(dtype=torch.float32), r"optimize_config.dtype"),
    (dict(), ipex_train.OptimizeConfig(dtype=BF16), r"optimize_config.dtype"),
    (dict(bf16=True, gradient_accumulation_steps=2, max_grad_norm=0),
     ipex_train.OptimizeConfig(step_in_backward=True), r"gradient_accumulation_steps=2"),
    (dict(bf16=True), ipex_train.OptimizeConfig(step_in_backward=True), r"max_grad_norm=1.0"),
])
def test_refused_settings_leave_the_model_alone(tmp_path, kw, config, match):
    model = tiny_bert()
    before = state(model)
    with pytest.raises(ValueError, match=match):
        Trainer(model=model, args=targs(tmp_path, **kw), optimize_config=config)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert_same(model.state_dict(), before)


def test_optimize_config_type_is_checked(tmp_path):
    with pytest.raises(TypeError, match="optimize_config must be an ipex_train.OptimizeConfig"):
        Trainer(model=tiny_bert(), args=targs(tmp_path), optimize_config={"step_in_backward": True})


def test_passed_optimizer_is_optimized_in_place_and_train_twice(tmp_path):
    """optimizers=(optimizer, scheduler): the optimizer is optimized in place, so its scheduler still drives it; a
    second train() keeps the optimized optimizer."""
    model = tiny_bert()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    t = Trainer(model=model, args=targs(tmp_path, bf16=True, max_steps=3), train_dataset=Data(),
                optimizers=(opt, sched))
    t.train()
    inner = t.optimizer.optimizer
    assert isinstance(inner, torch.optim.SGD) and ipex_train.summary(t.model, inner).fused_step == "sgd"
    assert inner.param_groups[0] is opt.param_groups[0] and opt.param_groups[0]["lr"] == pytest.approx(0.1 / 4)
    t.train()
    assert t.optimizer.optimizer is inner
