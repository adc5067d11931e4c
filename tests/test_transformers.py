"""An optimize(bf16)-trained HuggingFace model saves checkpoints that reload as its exact fp32 weights in vanilla
transformers (save_pretrained, Trainer.save_model and the Trainer's checkpoints), and the Trainer resumes from
them exactly."""
import copy
import json
import os

import pytest
import torch

import ipex_train

transformers = pytest.importorskip("transformers")

BF16 = torch.bfloat16


def tiny_bert():
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, num_labels=3))


class Data(torch.utils.data.Dataset):
    def __init__(self, n=16):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 50, (n, 8), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i, 0] % 3}


def trained():
    model = tiny_bert().train()
    model, opt = ipex_train.optimize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), dtype=BF16)
    batch = Data()[0]
    for _ in range(2):
        opt.zero_grad()
        model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss.backward()
        opt.step()
    return model


def assert_reloads_exactly(path, model):
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["dtype"] == "float32"
    vanilla = type(model).from_pretrained(path)
    want = model.state_dict()
    got = vanilla.state_dict()
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def test_save_pretrained_reloads_exact_fp32(tmp_path):
    model = trained()
    assert model.bert.embeddings.word_embeddings.weight.dtype == BF16
    assert any(not torch.equal(v, v.to(BF16).float()) for v in model.state_dict().values())  # bf16 would lose bits
    model.save_pretrained(tmp_path)
    assert_reloads_exactly(tmp_path, model)
    # Only the saved config changes: the live model still computes (and sizes its masks) in bf16.
    assert model.dtype == BF16 and type(model) is transformers.BertForSequenceClassification
    copied = copy.deepcopy(model)
    copied.save_pretrained(tmp_path / "copy")
    assert_reloads_exactly(tmp_path / "copy", model)
    torch.save(model, tmp_path / "model.pt")
    unpickled = torch.load(tmp_path / "model.pt", weights_only=False)
    unpickled.save_pretrained(tmp_path / "unpickled")
    assert_reloads_exactly(tmp_path / "unpickled", model)


def test_trainer_checkpoints_reload_exact_and_resume(tmp_path):
    def trainer(out):
        model = tiny_bert().train()
        model, opt = ipex_train.optimize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), dtype=BF16,
                                         inplace=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        args = transformers.TrainingArguments(out, per_device_train_batch_size=4, max_steps=4, save_steps=2,
                                              use_cpu=True, report_to=[], disable_tqdm=True, seed=0)
        return transformers.Trainer(model=model, args=args, train_dataset=Data(), optimizers=(opt, sched))

    first = trainer(tmp_path / "run")
    first.train()
    first.save_model(tmp_path / "final")
    assert_reloads_exactly(tmp_path / "final", first.model)
    assert_reloads_exactly(tmp_path / "run" / "checkpoint-4", first.model)

    second = trainer(tmp_path / "run")  # a fresh model and optimizer, resumed from step 2
    second.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    want, got = first.model.state_dict(), second.model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())


@pytest.mark.parametrize("policy", ["emulated", "native"])
def test_gradient_checkpointing_trains_as_without(policy):
    # Checkpointing recomputes each layer during backward, outside the model's forward: the compute policy must
    # cover the recomputation too (under the emulated policy GPT-2's recomputed Conv1D failed with a dtype mismatch).
    def run(checkpointing):
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config)
        if checkpointing:
            model.gradient_checkpointing_enable()
        model.train()
        model, opt = ipex_train.optimize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), dtype=BF16,
                                         bf16_compute=policy)
        ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
        losses = []
        for _ in range(3):
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    plain = run(False)
    torch.testing.assert_close(torch.tensor(run(True)), torch.tensor(plain), rtol=1e-3, atol=0)
    assert plain[-1] < plain[0]


def test_trainer_with_step_in_backward(tmp_path):
    # The HF Trainer asks clip_grad_norm_(params, inf) for the grad norm it logs, every step: allowed (with a
    # warning: the grads are gone, so it reads 0). Real clipping (max_grad_norm > 0, its default) is refused.
    def trainer(max_grad_norm):
        model = tiny_bert().train()
        model, opt = ipex_train.optimize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), dtype=BF16,
                                         step_in_backward=True)
        args = transformers.TrainingArguments(tmp_path, per_device_train_batch_size=4, max_steps=3, use_cpu=True,
                                              report_to=[], disable_tqdm=True, seed=0, save_strategy="no",
                                              max_grad_norm=max_grad_norm)
        return transformers.Trainer(model=model, args=args, train_dataset=Data(), optimizers=(opt, None))

    with pytest.raises(RuntimeError, match=r"clip_grad_norm_: these parameters are stepped inside backward.*"
                                           r"max_grad_norm=0"):
        trainer(1.0).train()
    t = trainer(0.0)
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    t.train()
    after = t.model.state_dict()
    assert all(not torch.equal(after[k], v) for k, v in before.items() if v.is_floating_point() and v.numel() > 16)
    assert all(p.grad is None for p in t.model.parameters())
