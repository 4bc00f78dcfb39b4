"""PyTorch peer: jamp's three benchmark networks and their mixed-precision train step in PyTorch.

The benchmark suite times jamp against this reference: the same networks (jamp.models' SeedCNN,
resnet20 and TransformerLM, with the same layers, parameter counts and initializers) trained by
the step a PyTorch user would write with torch.autocast on CPU. The suite does::

    import peers_torch
    ok, why = peers_torch.available()  # (False, reason) when torch is missing: report a skip
    step = peers_torch.make_step("resnet20", "mixed_bfloat16", batch)  # may raise PeerUnsupported
    loss = step()  # one full train step on the fixed batch; returns the detached loss

Policies (fp32 parameters and Adam(1e-4) state throughout):

  float32         plain fp32, matmul precision "highest" (no bf16 inside fp32 matmuls)
  mixed_bfloat16  torch.autocast("cpu", dtype=torch.bfloat16) around forward and loss
  mixed_float16   torch.autocast("cpu", dtype=torch.float16) plus torch.amp.GradScaler("cpu")

Batches are numpy: {"image": f32[B, H, W, C] (NHWC, as jamp), "label": int[B]} or
{"tokens": int[B, L]} (next-token loss of tokens[:, :-1] -> tokens[:, 1:]). Images go to the
conv nets as NCHW-shaped tensors in channels_last memory, which oneDNN runs fastest.

    python experiments/peers_torch.py  # self-check, ~1 min
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import os
import time
from typing import Callable

import numpy as np

try:
    import torch
    import torch.nn.functional as F
    from torch import nn

    _IMPORT_ERROR = ""
except ImportError as e:  # the suite reports the peer as skipped
    torch = F = nn = None
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"

# Base class for the modules below; `object` keeps this file importable without torch.
_Module = nn.Module if nn is not None else object

MODELS = ("seed_cnn", "resnet20", "transformer_lm")
POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
CHANNELS_LAST = True  # memory format of the conv nets' activations and weights
_LECUN_TRUNC = 0.87962566103423978  # std of a unit normal truncated to [-2, 2], as Flax uses


class PeerUnsupported(RuntimeError):
    """This model x policy cannot run with the installed torch (the suite reports a skip)."""


def available() -> tuple[bool, str]:
    """(True, torch version) or (False, why torch cannot be used)."""
    if torch is None:
        return False, f"torch not importable ({_IMPORT_ERROR})"
    return True, f"torch {torch.__version__}"


# ----- networks (jamp.models in PyTorch)


class SeedCNN(_Module):
    """conv 32 + ReLU; conv 64 + ReLU + 2x2 max-pool; dense 256 + ReLU; dense classes."""

    def __init__(self, num_classes: int = 10, image_shape: tuple = (32, 32, 3)):
        super().__init__()
        height, width, channels = image_shape
        self.conv1 = nn.Conv2d(channels, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.dense1 = nn.Linear(64 * (height // 2) * (width // 2), 256)
        self.dense2 = nn.Linear(256, num_classes)

    def forward(self, images):
        x = F.relu(self.conv1(images))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = x.permute(0, 2, 3, 1).flatten(1)  # HWC order, as Flax's NHWC reshape
        return self.dense2(F.relu(self.dense1(x)))


def _bn(channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels, eps=1e-5, momentum=0.1)  # Flax momentum 0.9


class BasicBlock(_Module):
    """Two 3x3 convs with batch norm; identity or 1x1-conv + BN shortcut; last BN scale zero."""

    def __init__(self, in_filters: int, filters: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_filters, filters, 3, stride, padding=1, bias=False)
        self.bn1 = _bn(filters)
        self.conv2 = nn.Conv2d(filters, filters, 3, padding=1, bias=False)
        self.bn2 = _bn(filters)
        self.bn2.zero_init = True  # read by _flax_init
        self.shortcut = nn.Identity()
        if stride != 1 or in_filters != filters:
            conv = nn.Conv2d(in_filters, filters, 1, stride, bias=False)
            self.shortcut = nn.Sequential(conv, _bn(filters))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(self.shortcut(x) + y)


class ResNet(_Module):
    """CIFAR ResNet: 3x3 stem + BN, stages of BasicBlocks, global mean pool, dense head."""

    def __init__(self, num_filters=16, num_classes=10, in_channels=3, stage_sizes=(3, 3, 3)):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, num_filters, 3, padding=1, bias=False), _bn(num_filters)
        )
        blocks, width = [], num_filters
        for stage, num_blocks in enumerate(stage_sizes):
            for block in range(num_blocks):
                stride = 2 if stage > 0 and block == 0 else 1
                blocks.append(BasicBlock(width, num_filters * 2**stage, stride))
                width = num_filters * 2**stage
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(width, num_classes)

    def forward(self, images):
        x = self.blocks(F.relu(self.stem(images)))
        return self.head(x.mean(dim=(2, 3)))


class SelfAttention(_Module):
    """Causal multi-head self-attention; q, k, v and out projections with biases (fused q/k/v)."""

    def __init__(self, d_model: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x):
        batch, length, d_model = x.shape
        qkv = self.qkv(x).view(batch, length, 3, self.num_heads, d_model // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [B, heads, L, head_dim]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, length, d_model))


class DecoderBlock(_Module):
    """Pre-LayerNorm attention and GELU (tanh) MLP, each with a residual connection."""

    def __init__(self, d_model: int, num_heads: int, mlp_dim: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model, eps=1e-6)
        self.attn = SelfAttention(d_model, num_heads)
        self.ln2 = nn.LayerNorm(d_model, eps=1e-6)
        self.mlp_in = nn.Linear(d_model, mlp_dim)
        self.mlp_out = nn.Linear(mlp_dim, d_model)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.ln2(x)), approximate="tanh"))


class TransformerLM(_Module):
    """Decoder-only LM: token + learned position embedding, blocks, LayerNorm, tied output."""

    def __init__(
        self,
        vocab_size: int = 256,
        num_layers: int = 4,
        d_model: int = 256,
        num_heads: int = 4,
        mlp_dim: int = 1024,
        max_len: int = 1024,
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos_embedding = nn.Parameter(torch.empty(max_len, d_model))
        blocks = [DecoderBlock(d_model, num_heads, mlp_dim) for _ in range(num_layers)]
        self.blocks = nn.Sequential(*blocks)
        self.ln = nn.LayerNorm(d_model, eps=1e-6)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos_embedding[: tokens.shape[1]]
        x = self.ln(self.blocks(x))
        return F.linear(x, self.embed.weight)  # x @ embed.T, no bias


def _flax_init(module) -> None:
    """Flax's default initializers (lecun_normal kernels, zero biases, ...) on `module`."""
    if isinstance(module, nn.Conv2d | nn.Linear):
        std = 1 / math.sqrt(module.weight[0].numel()) / _LECUN_TRUNC  # fan_in
        nn.init.trunc_normal_(module.weight, std=std, a=-2 * std, b=2 * std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=1 / math.sqrt(module.embedding_dim))
    elif isinstance(module, nn.BatchNorm2d) and getattr(module, "zero_init", False):
        nn.init.zeros_(module.weight)
    elif isinstance(module, TransformerLM):
        nn.init.normal_(module.pos_embedding, std=0.02)


def build_net(model: str, **model_config):
    """The named network, Flax-initialized from torch's current RNG state.

    model_config: seed_cnn: num_classes, image_shape (H, W, C); resnet20 (stages 3, 3, 3):
    num_classes, num_filters, in_channels; transformer_lm: vocab_size (or num_classes, as
    jamp.models' registry calls it), num_layers, d_model, num_heads, mlp_dim, max_len.
    """
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; accepted: {', '.join(MODELS)}")
    config = dict(model_config)
    if model == "transformer_lm":
        if "num_classes" in config:
            config["vocab_size"] = config.pop("num_classes")
        if config.pop("dropout_rate", 0.0):
            raise ValueError("transformer_lm peer: only dropout_rate=0 (jamp's default)")
    cls = {"seed_cnn": SeedCNN, "resnet20": ResNet, "transformer_lm": TransformerLM}[model]
    try:
        net = cls(**config)
    except TypeError as e:
        raise ValueError(
            f"model {model!r} does not accept model_config {model_config}: {e}"
        ) from None
    net.apply(_flax_init)
    return net


def param_count(model: str, **model_config) -> int:
    """Trainable parameters (the tied embedding counted once; BN running stats excluded)."""
    _require_torch()
    return sum(p.numel() for p in build_net(model, **model_config).parameters())


# ----- the train step


def _require_torch() -> None:
    ok, why = available()
    if not ok:
        raise PeerUnsupported(why)


@functools.cache
def _set_threads() -> None:
    torch.set_num_threads(os.cpu_count() or 1)


def _inputs(model: str, batch: dict, channels_last: bool) -> tuple:
    """(network input, targets) as torch tensors, created once."""
    if model == "transformer_lm":
        tokens = torch.from_numpy(np.asarray(batch["tokens"], np.int64))
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    images = torch.from_numpy(np.asarray(batch["image"], np.float32)).permute(0, 3, 1, 2)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    labels = torch.from_numpy(np.asarray(batch["label"], np.int64))
    return images.contiguous(memory_format=fmt), labels


def _net_loss(net, x, y):
    logits = net(x)
    return F.cross_entropy(logits.float().flatten(0, -2), y.flatten())


def _autocast(policy: str) -> Callable[[], contextlib.AbstractContextManager]:
    if policy == "float32":
        return contextlib.nullcontext
    dtype = torch.bfloat16 if policy == "mixed_bfloat16" else torch.float16
    return functools.partial(torch.autocast, "cpu", dtype=dtype)


def _probe(net, x, y, autocast, policy: str) -> None:
    """Forward + backward of a copy on two examples; raises PeerUnsupported if an op fails."""
    try:
        with autocast():
            loss = _net_loss(copy.deepcopy(net), x[:2], y[:2])
        loss.backward()
        if policy == "mixed_float16":
            torch.amp.GradScaler("cpu")
    except (RuntimeError, NotImplementedError, ValueError) as e:
        msg = str(e).splitlines()[0]
        raise PeerUnsupported(f"{policy} on CPU with torch {torch.__version__}: {msg}") from e


def make_step(
    model: str,
    policy: str,
    batch: dict,
    seed: int = 0,
    channels_last: bool = CHANNELS_LAST,
    **model_config,
) -> Callable[[], object]:
    """A zero-argument callable doing one Adam(1e-4) train step on `batch`; returns the loss.

    `channels_last` picks the conv nets' memory format (oneDNN's fastest here, fp32 and bf16).
    oneDNN builds its kernels during the first few steps: warm up ~5 steps before timing.

    Raises:
      PeerUnsupported: torch is missing, or the policy's ops fail on this CPU / torch build.
      ValueError: unknown model or policy.
    """
    _require_torch()
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; accepted: {', '.join(POLICIES)}")
    _set_threads()
    torch.set_float32_matmul_precision("highest")
    torch.manual_seed(seed)
    if model == "seed_cnn":
        model_config.setdefault("image_shape", np.shape(batch["image"])[1:])
    elif model == "resnet20":
        model_config.setdefault("in_channels", np.shape(batch["image"])[-1])
    net = build_net(model, **model_config).train()
    if model != "transformer_lm" and channels_last:
        net = net.to(memory_format=torch.channels_last)
    x, y = _inputs(model, batch, channels_last)
    autocast = _autocast(policy)
    if policy != "float32":
        _probe(net, x, y, autocast, policy)
    opt = torch.optim.Adam(net.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu") if policy == "mixed_float16" else None

    def step():
        opt.zero_grad(set_to_none=True)
        with autocast():
            loss = _net_loss(net, x, y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        return loss.detach()

    return step


# ----- self-check: python experiments/peers_torch.py


def _check_batch(model: str, rng: np.random.Generator) -> dict:
    if model == "transformer_lm":
        return {"tokens": rng.integers(0, 256, (16, 129))}
    image = rng.standard_normal((64, 32, 32, 3), dtype=np.float32)
    return {"image": image, "label": rng.integers(0, 10, 64)}


def _self_check(warmup: int = 3, steps: int = 5) -> None:
    print(available()[1], "threads", os.cpu_count(), "channels_last", CHANNELS_LAST)
    for model in MODELS:
        print(f"{model}: {param_count(model):,} params")
        batch = _check_batch(model, np.random.default_rng(0))
        for policy in POLICIES:
            try:
                step = make_step(model, policy, batch)
            except PeerUnsupported as e:
                print(f"  {policy:15s} skipped: {e}")
                continue
            losses = [float(step()) for _ in range(warmup)]
            start = time.perf_counter()
            losses += [float(step()) for _ in range(steps)]
            ms = (time.perf_counter() - start) / steps * 1e3
            trend = "decreasing" if losses[-1] < losses[0] else "NOT decreasing"
            finite = all(math.isfinite(v) for v in losses)
            print(f"  {policy:15s} {ms:8.1f} ms/step  loss {losses[0]:.4f} -> {losses[-1]:.4f} "
                  f"({trend}, {'finite' if finite else 'NOT finite'})")  # fmt: skip


if __name__ == "__main__":
    _self_check()
