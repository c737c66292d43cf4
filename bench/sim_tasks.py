"""The two tasks of the scaling studies (``bench_sim_study.py``), each a model, its data, the
global batch of every step and the validation loss, for k workers simulated in one process.

- ``chars``: the outer study's task (``bench_outer_study.py``): a character-level MLP (the 8
  previous characters of the chars demo's text, embedded in 16 dimensions, two hidden layers of
  128 GELU units, 47,234 parameters), the next character's cross entropy, validation on 8,192
  fixed held-out windows.
- ``stdlib``: a byte-level GPT (``ByteGPT``: 256 byte ids, 4 pre-norm blocks of width 128, 4
  heads, context 32, 863,232 parameters) on the
  source of the whole standard library: every ``.py`` file under
  ``sysconfig.get_paths()["stdlib"]`` (site-packages left out), about 31 MB, split by file: a
  file whose path (relative, '/'-separated) has a CRC-32 divisible by 20 is validation text
  (about 5%), every other one training text. The files are joined in sorted order with a
  newline between them. Validation: 256 windows evenly spaced over the validation text.
- ``stdlib-30m``: the same data and batch with a GPT of width 512, 8 heads and 10 blocks
  (31.8M parameters), for a GPU.

Every step's global batch (``Task.batch_starts``) is drawn from a generator seeded by the seed
alone, the same for every method and every number of workers; worker w of k takes rows
w B/k .. (w+1) B/k - 1 of it. Nothing is downloaded.
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import bench_outer_study as outer_study
from dlion_kernels.demo import chars

# the stdlib GPT
BYTES = 256
GPT_WIDTH, GPT_HEADS, GPT_LAYERS, GPT_CONTEXT = 128, 4, 4, 32
GPT_EVAL_WINDOWS = 256
# the same GPT at about 30M parameters, for a GPU (width 512, 8 heads, 10 blocks)
GPT_LARGE_WIDTH, GPT_LARGE_HEADS, GPT_LARGE_LAYERS = 512, 8, 10
VALIDATION_EVERY = 20  # a file goes to validation when crc32(path) % 20 == 0


@dataclass
class Task:
    """A model family and its data; ``inputs(ids, starts)`` turns window starts into a batch."""

    name: str
    batch: int          # windows in the global batch of one step
    inner_lr: float     # DiLoCo's inner AdamW lr (and the AdamW baseline's grid centre)
    weight_decay: float
    steps: int          # the study's budget in steps (global batches)
    tokens_per_window: int  # predicted tokens per window: the budget in tokens
    train: torch.Tensor | None = None
    val: torch.Tensor | None = None

    def load(self):
        if self.train is None:
            self.train, self.val = _DATA[self.name]()
            self._val_batch = self.inputs(self.val, self.val_starts())
        return self

    def make_model(self, seed: int) -> torch.nn.Module:
        return _MODELS[self.name](seed)

    def window(self) -> int:
        """Ids one window reads (inputs and targets)."""
        return outer_study.CONTEXT + 1 if self.name == "chars" else GPT_CONTEXT + 1

    def batch_starts(self, seed: int, steps: int) -> torch.Tensor:
        """[steps, batch] window starts: every step's global batch, the same for every method
        and number of workers."""
        gen = torch.Generator().manual_seed(1_000_003 * seed + 17)
        return torch.randint(0, len(self.train) - self.window(), (steps, self.batch),
                             generator=gen)

    def val_starts(self) -> torch.Tensor:
        windows = outer_study.EVAL_WINDOWS if self.name == "chars" else GPT_EVAL_WINDOWS
        return torch.linspace(0, len(self.val) - self.window() - 1, windows).round().long()

    def inputs(self, ids: torch.Tensor, starts: torch.Tensor):
        """(inputs, targets) of the windows at ``starts`` (any leading shape)."""
        w = ids[starts[..., None] + torch.arange(self.window())].long()
        if self.name == "chars":
            return w[..., :-1], w[..., -1]
        return w[..., :-1], w[..., 1:]

    def val_batch(self):
        return self._val_batch

    @property
    def budget_tokens(self) -> int:
        return self.steps * self.batch * self.tokens_per_window


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-id cross entropy (nats)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ----------------------------------------------------------------------------- data


def _chars_data():
    return chars.load_text()


def stdlib_files() -> list[str]:
    """Relative '/'-separated paths of the standard library's .py files, sorted."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__")]
        for f in files:
            if f.endswith(".py"):
                out.append(os.path.relpath(os.path.join(folder, f), root).replace(os.sep, "/"))
    return sorted(out)


def is_validation(path: str) -> bool:
    return zlib.crc32(path.encode()) % VALIDATION_EVERY == 0


def _stdlib_data():
    root = sysconfig.get_paths()["stdlib"]
    train, val = bytearray(), bytearray()
    for path in stdlib_files():
        with open(os.path.join(root, *path.split("/")), "rb") as f:
            data = f.read() + b"\n"
        (val if is_validation(path) else train).extend(data)
    return (torch.frombuffer(train, dtype=torch.uint8).clone(),
            torch.frombuffer(val, dtype=torch.uint8).clone())


_DATA = {"chars": _chars_data, "stdlib": _stdlib_data, "stdlib-30m": _stdlib_data}


# ----------------------------------------------------------------------------- models


def _chars_model(seed: int):
    return outer_study.make_model(seed)


class _Block(torch.nn.Module):
    """Pre-norm transformer block: causal self-attention (written out with matmuls, so that
    ``vmap`` over workers batches it), then a 4x GELU MLP."""

    def __init__(self, d: int, heads: int, context: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(),
                                       torch.nn.Linear(4 * d, d))
        mask = torch.full((context, context), float("-inf")).triu(1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x):
        b, t, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) * (d // h) ** -0.5 + self.mask[:t, :t]
        y = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.mlp(self.norm2(x))


class ByteGPT(torch.nn.Module):
    """A small GPT on byte ids: token and position embeddings, pre-norm blocks, a final norm
    and a linear head."""

    def __init__(self, vocab: int, d: int, heads: int, layers: int, context: int):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(context, d)
        self.blocks = torch.nn.ModuleList(_Block(d, heads, context) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.tok(idx) + self.pos.weight[: idx.shape[-1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _stdlib_model(seed: int):
    torch.manual_seed(seed)
    return ByteGPT(BYTES, GPT_WIDTH, GPT_HEADS, GPT_LAYERS, GPT_CONTEXT)


def _stdlib_large_model(seed: int):
    torch.manual_seed(seed)
    return ByteGPT(BYTES, GPT_LARGE_WIDTH, GPT_LARGE_HEADS, GPT_LARGE_LAYERS, GPT_CONTEXT)


_MODELS = {"chars": _chars_model, "stdlib": _stdlib_model, "stdlib-30m": _stdlib_large_model}

TASKS = {
    # the outer study's settings: 32 windows per worker at k = 4, AdamW lr 3e-3, wd 0.01,
    # 2048 steps
    "chars": Task("chars", batch=128, inner_lr=outer_study.INNER_LR,
                  weight_decay=outer_study.WEIGHT_DECAY, steps=2048, tokens_per_window=1),
    # 64 windows of 32 bytes: one window per worker at k = 64
    "stdlib": Task("stdlib", batch=64, inner_lr=3e-3, weight_decay=1e-2, steps=256,
                   tokens_per_window=GPT_CONTEXT),
    # the GPU's task: the same data and batch, a model 36x larger, a lower lr
    "stdlib-30m": Task("stdlib-30m", batch=64, inner_lr=1e-3, weight_decay=1e-2, steps=256,
                       tokens_per_window=GPT_CONTEXT),
}


def numel(task: str) -> int:
    return sum(p.numel() for p in TASKS[task].make_model(0).parameters())
