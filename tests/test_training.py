"""A small real training run: a byte-level causal transformer on CPython's pydoc topics text.

QAdamW with int8 states (every tensor quantized, ``min_quant_size=0``) must end within 1% of fp32
AdamW's validation loss.
"""

from __future__ import annotations

import pydoc_data.topics

import torch

import lightning_qstate as lq

SEQ, BATCH, STEPS, WIDTH = 48, 16, 200, 64


def corpus() -> tuple[torch.Tensor, torch.Tensor]:
    text = "\n".join(pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics))
    data = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
    split = int(0.9 * data.numel())
    return data[:split], data[split:]


class ByteTransformer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, WIDTH)
        self.position = torch.nn.Parameter(torch.randn(SEQ, WIDTH) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(WIDTH, 4, 4 * WIDTH, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(WIDTH, 256)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens) + self.position[: tokens.shape[1]]
        return self.head(self.blocks(hidden, mask=self.mask, is_causal=True))


def batches(data: torch.Tensor, seed: int, count: int):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(count):
        starts = torch.randint(0, data.numel() - SEQ - 1, (BATCH,), generator=gen)
        window = torch.stack([data[s : s + SEQ + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


def loss_of(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(inputs).reshape(-1, 256), targets.reshape(-1))


def train_and_validate(make_optimizer) -> float:
    train, val = corpus()
    torch.manual_seed(0)
    model = ByteTransformer()
    optimizer = make_optimizer(model.parameters())
    for inputs, targets in batches(train, seed=1, count=STEPS):
        optimizer.zero_grad()
        loss_of(model, inputs, targets).backward()
        optimizer.step()
    with torch.no_grad():
        return sum(float(loss_of(model, x, y)) for x, y in batches(val, seed=2, count=20)) / 20


def test_int8_states_reach_fp32_loss():
    fp32 = train_and_validate(lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.01))
    int8 = train_and_validate(lambda p: lq.QAdamW(p, lr=3e-3, weight_decay=0.01, states="int8", min_quant_size=0))
    assert fp32 < 3.0, "the fp32 baseline should learn well beyond the uniform 5.55 nats"
    assert int8 <= fp32 * 1.01, f"int8 states: val loss {int8:.4f} vs fp32 {fp32:.4f}"
