"""Tiny Hugging Face models built from configs (no download) for the export/import tests,
and ``--model`` factories for ``unbroken import``."""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 128


def llama_config(tie: bool = False):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        tie_word_embeddings=tie,
    )


def llama(tie: bool = False, seed: int = 0) -> nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(tie)).eval()


def lora(model: nn.Module, *, bias: str = "none", modules_to_save=None) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        lora_dropout=0.0,
        bias=bias,
        modules_to_save=modules_to_save,
    )
    torch.manual_seed(1)
    return get_peft_model(model, config)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    """AdamW steps on fixed token batches (dropout off: the models are in eval mode)."""
    for step in steps:
        g = torch.Generator().manual_seed(1000 + step)
        ids = torch.randint(0, VOCAB, (2, 8), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()


def llama_and_adamw() -> tuple[nn.Module, torch.optim.Optimizer]:
    """``--model`` factory: an untrained tiny Llama (other seed) and its AdamW."""
    model = llama(seed=7)
    return model, adamw(model)


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def llama_lora() -> nn.Module:
    """``--model`` factory: the base Llama (seed 0) with a fresh LoRA adapter."""
    return lora(llama())
