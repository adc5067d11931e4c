"""The models bench_train_step trains, each built from code or a config (nothing downloaded).

``MODELS`` maps a name to a :class:`ModelSpec`: a builder, the input shape (batch first), the optimizer and learning
rate, and the signal scale of the synthetic task. Transformer inputs are embeddings (float), so these models take a
float tensor and return class logits; those with a vocabulary (``ModelSpec.vocab``, e.g. ``bert_base_tokens``) take
token ids instead, as a fine-tune feeds them (:func:`example_input` makes either).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

NUM_CLASSES = 10


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 convs with BatchNorm and a projected shortcut when needed."""

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class SmallResNet(nn.Module):
    """ResNet-style CNN for 64x64 inputs, ~2.7M parameters."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU())
        widths = [(32, 64, 2), (64, 128, 2), (128, 128, 1), (128, 256, 2), (256, 256, 1)]
        self.blocks = nn.Sequential(*(BasicBlock(i, o, s) for i, o, s in widths))
        self.head = nn.Linear(256, NUM_CLASSES)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class Encoder(nn.Module):
    """nn.TransformerEncoder stack (4 layers, d_model 512) with a mean-pool classifier head."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(512, 8, 2048, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.head = nn.Linear(512, NUM_CLASSES)

    def forward(self, x):
        return self.head(self.encoder(x).mean(1))


class BertLike(nn.Module):
    """HuggingFace BertModel from a BERT-base config (hidden 768, 12 heads, FFN 3072), by default 4 of its 12 layers
    so that quick mode fits in minutes on 2 cores, fed embeddings; classifier on the pooled [CLS] output."""

    def __init__(self, layers: int = 4):
        super().__init__()
        from transformers import BertConfig, BertModel

        config = BertConfig(num_hidden_layers=layers, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        self.bert = BertModel(config, add_pooling_layer=True)
        self.head = nn.Linear(config.hidden_size, NUM_CLASSES)

    def forward(self, x):
        if not x.is_floating_point():  # token ids (bert_base_tokens): the embeddings' own lookup, as in a fine-tune
            return self.head(self.bert(input_ids=x).pooler_output)
        return self.head(self.bert(inputs_embeds=x).pooler_output)


def _vit():
    """torchvision VisionTransformer, ViT-S/8 shape (6 layers of 12) for 64x64 inputs."""
    from torchvision.models import VisionTransformer

    return VisionTransformer(image_size=64, patch_size=8, num_layers=6, num_heads=6, hidden_dim=384, mlp_dim=1536,
                             num_classes=NUM_CLASSES)


def _vit_b16():
    """torchvision ViT-B/16 at 224 px (12 layers, hidden 768, 197 tokens)."""
    from torchvision.models import vit_b_16

    return vit_b_16(num_classes=NUM_CLASSES)


class LlamaLike(nn.Module):
    """HuggingFace LlamaModel from a config (8 layers, hidden 768, 12 query heads over 4 key/value heads, SwiGLU FFN
    2048, causal attention), fed embeddings, or token ids of a ``vocab``-sized vocabulary (Llama-2's: 32000);
    classifier on the mean of the last hidden states."""

    def __init__(self, vocab: int = 256):
        super().__init__()
        from transformers import LlamaConfig, LlamaModel

        config = LlamaConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=12,
                             num_key_value_heads=4, vocab_size=vocab, max_position_embeddings=512,
                             attn_implementation="sdpa")
        self.llama = LlamaModel(config)
        self.head = nn.Linear(config.hidden_size, NUM_CLASSES)

    def forward(self, x):
        if not x.is_floating_point():  # token ids (llama_s256_tokens): the embeddings' lookup, as in a fine-tune
            return self.head(self.llama(input_ids=x).last_hidden_state.mean(1))
        return self.head(self.llama(inputs_embeds=x).last_hidden_state.mean(1))


def _resnet50():
    from torchvision.models import resnet50

    return resnet50(num_classes=NUM_CLASSES)


def _timm(name: str, **kwargs) -> Callable[[], nn.Module]:
    """A timm model built from its config (``pretrained=False``: nothing downloaded)."""

    def build():
        import timm

        return timm.create_model(name, pretrained=False, num_classes=NUM_CLASSES, **kwargs)

    return build


def sgd(params, lr: float) -> torch.optim.Optimizer:
    """SGD with momentum: updates linear in the gradient, unlike Adam's early sign-like steps."""
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def timm_adamw(params, lr: float) -> torch.optim.Optimizer:
    """timm's optimizer factory, as timm's train script builds it (AdamW, weight decay 0.05)."""
    import timm.optim

    return timm.optim.create_optimizer_v2(params, "adamw", lr=lr, weight_decay=0.05)


@dataclass(frozen=True)
class ModelSpec:
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    lr: float
    signal: float  # class template scale against unit noise: sets how fast the task is learnt
    optimizer: Callable[..., torch.optim.Optimizer] = sgd
    large: bool = False  # quick mode leaves out its torch.compile variants (minutes of compilation each)
    quick: bool = True  # quick mode runs it (every model runs in full mode)
    roof: bool = False  # the benchmark prints its step's share of the bf16 matmul roof measured in the same run
    vocab: int = 0  # > 0: the model takes token ids in [0, vocab) of input_shape, not a float tensor


def example_input(spec: ModelSpec, generator: torch.Generator | None = None) -> torch.Tensor:
    """One random input batch of ``spec``: token ids when it has a vocabulary, else a standard-normal float tensor."""
    if spec.vocab:
        return torch.randint(0, spec.vocab, spec.input_shape, generator=generator)
    return torch.randn(spec.input_shape, generator=generator)


MODELS = {
    "resnet_cnn": ModelSpec(SmallResNet, (16, 3, 64, 64), 0.003, 0.05),
    # lr 0.002: at 0.01 the fp32 run itself diverges after ~20 steps (its loss rises), and two diverging runs
    # cannot show whether two numerics agree.
    "transformer": ModelSpec(Encoder, (8, 128, 512), 0.002, 0.05, large=True),
    # Quick mode leaves out the two slowest (a transformer encoder and a CNN of the same kinds stay in it).
    "bert_like": ModelSpec(BertLike, (8, 128, 768), 0.002, 0.05, large=True, quick=False),
    "vit": ModelSpec(_vit, (16, 3, 64, 64), 0.002, 0.05, large=True),
    # Transformers at the bf16 matmul roof (docs/attention.md): full-size shapes, left out of quick mode.
    "bert_base": ModelSpec(functools.partial(BertLike, 12), (8, 128, 768), 0.002, 0.05, large=True, quick=False,
                           roof=True),
    # The same model fed token ids (BERT's vocabulary): the embeddings' lookup, so under optimize(bf16) the residual
    # stream is bf16 from the first layer on, where fed fp32 embeddings it stays fp32 (and every linear casts).
    "bert_base_tokens": ModelSpec(functools.partial(BertLike, 12), (8, 128), 0.002, 0.8, large=True, quick=False,
                                  roof=True, vocab=30522),
    "vit_b16": ModelSpec(_vit_b16, (4, 3, 224, 224), 0.002, 0.05, large=True, quick=False, roof=True),
    "llama_s256": ModelSpec(LlamaLike, (4, 256, 768), 0.002, 0.05, large=True, quick=False, roof=True),
    # Fed token ids: under optimize(bf16) the stream, the norms' outputs and the rotary tables are bf16 (fed fp32
    # embeddings, the rotary tables are fp32, every linear casts its input and the rotary route does not apply).
    "llama_s256_tokens": ModelSpec(functools.partial(LlamaLike, 32000), (4, 256), 0.002, 0.8, large=True,
                                   quick=False, roof=True, vocab=32000),
    "resnet50": ModelSpec(_resnet50, (8, 3, 64, 64), 0.003, 0.05, large=True, quick=False),
    # Small real CNNs: batch 8, 64 px, timm's optimizer; per-op overhead matters most here.
    "timm_resnet18": ModelSpec(_timm("resnet18"), (8, 3, 64, 64), 1e-3, 0.05, optimizer=timm_adamw, large=True),
    "timm_mobilenetv3": ModelSpec(_timm("mobilenetv3_small_100"), (8, 3, 64, 64), 1e-3, 0.05, optimizer=timm_adamw,
                                  large=True),
    "timm_vit_tiny": ModelSpec(_timm("vit_tiny_patch16_224", img_size=64), (8, 3, 64, 64), 1e-3, 0.05,
                               optimizer=timm_adamw, large=True, quick=False),
    "timm_convnext_atto": ModelSpec(_timm("convnext_atto"), (8, 3, 64, 64), 1e-3, 0.05, optimizer=timm_adamw,
                                    large=True, quick=False),
    "timm_efficientnet_b0": ModelSpec(_timm("efficientnet_b0"), (8, 3, 64, 64), 1e-3, 0.05, optimizer=timm_adamw,
                                      large=True, quick=False),
}
QUICK_MODELS = tuple(name for name, spec in MODELS.items() if spec.quick)
