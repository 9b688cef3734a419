"""A decoder-only transformer (GPT-2's architecture, as in nanoGPT) in plain torch: token and learned position
embeddings, pre-norm blocks held in `self.blocks` (an nn.ModuleList, so FSDP shards it block by block and
activation checkpointing wraps each block), causal `F.scaled_dot_product_attention` (flash attention where the
device has it), and optionally the output projection tied to the token embedding.

An ordinary `_target_` (conf/model/gpt.yaml): nothing in the trainer knows it is a language model. GPTPipeline
is the same network as an nn.Sequential (untied), for trainer.strategy=pipeline. Both expose
`flops_per_token()` for the MFU the trainer reports.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"model.n_embd={n_embd} must be a multiple of model.n_head={n_head}.")
        self.head_dim, self.dropout = n_embd // n_head, dropout
        # Three projections, not one fused: under tensor parallelism each splits by heads on its own.
        self.q, self.k, self.v = (nn.Linear(n_embd, n_embd, bias=bias) for _ in range(3))
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        # -1 heads: all of them, or this rank's share under tensor parallelism (the projections' output width).
        q, k, v = (p(x).view(batch, length, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(batch, length, -1)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd, bias=bias), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd, bias=bias), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int = 256, block_size: int = 256, n_layer: int = 4, n_head: int = 4,
                 n_embd: int = 128, dropout: float = 0.0, bias: bool = False, tie_weights: bool = True):
        super().__init__()
        self.block_size, self.n_layer, self.n_embd, self.tie_weights = block_size, n_layer, n_embd, tie_weights
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        if tie_weights:
            self.head.weight = self.wte.weight
        init_weights(self, n_layer)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        if length > self.block_size:
            raise ValueError(f"a sequence of {length} tokens is longer than model.block_size={self.block_size}.")
        positions = torch.arange(length, device=tokens.device)
        x = self.drop(self.wte(tokens) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def tensor_parallel_plan(self, sequence_parallel: bool = False, loss_parallel: bool = False) -> dict[str, str]:
        """Megatron's split of each block (trainer.tp): the attention's q, k, v and the MLP's first layer by output
        columns (each rank its heads, its hidden units), their output projections by input rows (one all-reduce
        each). Embeddings, norms and the output projection stay whole on every rank; with sequence parallelism
        (Megatron-SP, torchtitan's) the embeddings, norms and residual stream hold a share of the positions, and
        the token table and the (tied) output projection are split by vocabulary rows; with loss parallelism the
        logits stay split by vocabulary for the cross-entropy."""
        plan = dict(SEQUENCE_PARALLEL_PLAN if sequence_parallel else TENSOR_PARALLEL_PLAN)
        if loss_parallel:  # the logits split by vocabulary for the loss (the tied table is split by rows with it)
            plan.update(wte="embedding_sequence" if sequence_parallel else "embedding",
                        head="colwise_from_sequence_to_loss" if sequence_parallel else "colwise_to_loss")
        return plan

    def flops_per_token(self, length: int | None = None) -> float:
        """Training FLOPs per token (forward + backward), nanoGPT's and PaLM's convention: 6 x the parameters that
        multiply (all but the embedding lookups; the output projection counts, tied or not) + 12 x layers x width x
        sequence length for the attention scores and their weighted sum (causal masking not discounted)."""
        lookups = self.wpe.weight.numel() + (0 if self.tie_weights else self.wte.weight.numel())
        return flops(self, lookups, self.n_layer, self.n_embd, length or self.block_size)


class Embedding(nn.Module):
    """The pipeline's first stage: token and position embeddings."""

    def __init__(self, vocab_size: int, block_size: int, n_embd: int, dropout: float):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.drop(self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device)))


class Head(nn.Module):
    """The pipeline's last stage: the final norm and the output projection."""

    def __init__(self, vocab_size: int, n_embd: int, bias: bool):
        super().__init__()
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


class GPTPipeline(nn.Sequential):
    """The same transformer as GPT, as an nn.Sequential of embedding, blocks and head, so that
    trainer.strategy=pipeline can cut it between blocks (each child feeds the next). Its output projection is
    not tied to the embedding: the two live on the first and the last stage. Sharded or data-parallel, use GPT."""

    def __init__(self, vocab_size: int = 256, block_size: int = 256, n_layer: int = 4, n_head: int = 4,
                 n_embd: int = 128, dropout: float = 0.0, bias: bool = False):
        super().__init__(Embedding(vocab_size, block_size, n_embd, dropout),
                         *(Block(n_embd, n_head, dropout, bias) for _ in range(n_layer)), Head(vocab_size, n_embd, bias))
        self.block_size, self.n_layer, self.n_embd = block_size, n_layer, n_embd
        init_weights(self, n_layer)

    def tensor_parallel_plan(self) -> dict[str, str]:
        """The GPT's split of each block, for the blocks a pipeline stage holds (its children are numbered)."""
        return {pattern.replace("blocks.*.", "*."): style for pattern, style in TENSOR_PARALLEL_PLAN.items()}

    def flops_per_token(self, length: int | None = None) -> float:
        embedding = self[0]
        lookups = embedding.wpe.weight.numel() + embedding.wte.weight.numel()
        return flops(self, lookups, self.n_layer, self.n_embd, length or self.block_size)


TENSOR_PARALLEL_PLAN = {"blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise",
                        "blocks.*.attn.proj": "rowwise", "blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}


SEQUENCE_PARALLEL_PLAN = {
    "wte": "embedding_sequence", "wpe": "positions_sequence", "blocks.*.ln_1": "sequence", "blocks.*.ln_2": "sequence",
    "blocks.*.attn": "gather_sequence", "blocks.*.mlp": "gather_sequence", "blocks.*.attn.q": "colwise",
    "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise", "blocks.*.attn.proj": "rowwise_sequence",
    "blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise_sequence", "ln_f": "sequence",
    "head": "colwise_from_sequence",
}


def init_weights(model: nn.Module, n_layer: int) -> None:
    """GPT-2's: normal(0, 0.02) weights, zero biases, residual projections scaled down by the depth."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
    for name, parameter in model.named_parameters():
        if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
            nn.init.normal_(parameter, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))


def flops(model: nn.Module, lookups: int, n_layer: int, n_embd: int, length: int) -> float:
    multiplying = sum(p.numel() for p in model.parameters()) - lookups  # a tied matrix is one parameter, counted once
    return 6 * multiplying + 12 * n_layer * n_embd * length
